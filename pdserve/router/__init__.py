"""The router: the data plane of a PD deployment (HTTP front, tokenizer pool, registry and health,
routing policies, KV index, retries, auth). The control plane is pdserve/control."""
