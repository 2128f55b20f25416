"""pdserve: disaggregated prefill/decode LLM serving."""
