"""Model definitions and loading: config, weights, the Llama family, shared layers, RoPE."""
