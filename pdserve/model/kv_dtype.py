"""`cache.kv_dtype: auto`: the dtype a worker's KV cache holds. Torch-free (the dry run, the planner and
the worker's start resolve it too).

- A 16-bit model (model.dtype bfloat16 or float16, as on a GPU) keeps its KV in its own dtype.
- float32 activations over quantized weights (model.quantization int4 or int8, `auto` resolved from
  the stored file) keep a bfloat16 cache: a decode step at many streams or long contexts reads more KV
  than weights, the pool holds twice the tokens, and the weights' rounding dominates the cache's
  (benchmarks/quant_quality.py measures both). vLLM and llama.cpp keep 16-bit caches as well.
- float32 weights keep a float32 cache: what HF's float32 reference computes, token for token.
- MLA's latent cache and MoE models keep the model's dtype: expert-parallel ranks' pools hold no
  other, and a MoE model's tokens then do not depend on how many ranks serve it.

Both ends of a KV transfer must hold the same dtype, so a PD deployment resolves `auto` once for all
its workers (deployment_plan.pd_kv_dtype), from its decode role.
"""

from __future__ import annotations

from pdserve.config import Config
from pdserve.model.arch import ModelArch
from pdserve.model.describe import describe_model
from pdserve.model.stored_quant import resolve_quantization

AUTO = "auto"


def resolve_kv_dtype(config: Config, arch: ModelArch | None = None) -> str:
    """cache.kv_dtype as `config`'s engine keeps it: `auto` resolved by the rules above, any other value
    as given. `arch`: the model's, where the caller has it (else read from model.name's header)."""
    mc, want = config.model, config.cache.kv_dtype
    if want != AUTO:
        return want
    if mc.dtype != "float32" or resolve_quantization(mc.quantization, mc.name) not in ("int4", "int8"):
        return mc.dtype
    arch = arch or describe_model(mc.name)
    return mc.dtype if arch.is_mla or arch.is_moe else "bfloat16"
