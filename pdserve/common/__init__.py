"""What the router and the engine share, without torch: sampling parameters and prompt checks,
the output and logprob wire forms, the tokenizer and incremental detokenizer, errors.

The router process imports only this layer (never `pdserve.engine`, `pdserve.model` or torch),
so it starts in well under 120 MB; tests/test_import_contracts.py holds it to that."""
