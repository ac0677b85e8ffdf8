"""KV tiers under the radix tree: host memory (L2), a local disk (L3) and a shared store."""
