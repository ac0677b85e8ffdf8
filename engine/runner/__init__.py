"""Running one scheduled step: forward batch, model call, CUDA graphs, sampling."""
