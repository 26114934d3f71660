"""Prefill/decode disaggregation: the transfer state machine, KV transports, and both workers' connectors."""
