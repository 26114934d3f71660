"""pdserve: LLM serving with Prefill/Decode disaggregation."""
