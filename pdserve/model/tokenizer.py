"""Moved to pdserve.common.tokenizer (torch-free, shared with the router); re-exported here."""
from pdserve.common.tokenizer import TokenizerWrapper, tokenizer_from_gguf_fields, tokenizer_from_hf_dir

__all__ = ["TokenizerWrapper", "tokenizer_from_gguf_fields", "tokenizer_from_hf_dir"]
