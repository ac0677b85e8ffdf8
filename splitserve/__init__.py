"""splitserve: disaggregated prefill/decode LLM serving."""
