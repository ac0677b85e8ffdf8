"""Scheduling: the per-request state, the prefix-cache interface and continuous batching."""
