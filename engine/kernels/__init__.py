"""Hand-written kernels the engine calls where they beat torch's ops."""
