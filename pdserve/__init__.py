"""pdserve: LLM serving with Prefill/Decode disaggregation."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy: `import pdserve` stays cheap for the CLI and for processes that never load torch.
    if name == "LLM":
        from pdserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from pdserve.common.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(name)
