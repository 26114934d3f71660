"""Logits of one sequence run through a model over a paged KV cache: chunked prefill, then decode
steps. Shared by the parity tests against HF transformers. (pytest puts tests/ on the path.)"""

from __future__ import annotations

import torch

from pdserve.model.attention import build_metadata


def paged_logits(model, ids: list[int], chunk: int, decode: int, block: int = 4) -> torch.Tensor:
    a = model.arch
    blocks = list(range((len(ids) + block - 1) // block + 1))
    kv = torch.zeros(a.kv_cache_shape(len(blocks) * block))
    out, done = [], 0
    prompt_len = len(ids) - decode
    while done < len(ids):
        n = min(chunk, prompt_len - done) if done < prompt_len else 1
        meta = build_metadata([(blocks, done, n)], block, a.sliding_window, "cpu")
        out.append(
            model.forward(
                torch.tensor(ids[done : done + n]), torch.arange(done, done + n), meta, kv, torch.arange(n)
            )
        )
        done += n
    return torch.cat(out)


def assert_logprobs_close(got: list[float], want: list[float]) -> None:
    """Logprobs from two float32 paths of one model (chunked and paged, or served, vs one whole
    forward): they differ in the order of their sums only, a few ulps of logits some tens in size."""
    g, w = torch.tensor(got, dtype=torch.float64), torch.tensor(want, dtype=torch.float64)
    assert torch.all((g - w).abs() <= 1e-4 * (1 + w.abs())), (g - w).abs().max()
