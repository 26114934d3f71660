"""The KV tiers' weight digest of a checkpoint on disk (hf_files.HFWeights.digest) comes from samples
the build's own reads take: an engine starting on a Hugging Face directory, dense or MoE, reads each
tensor once (a MoE layer's router twice: its gate in the model dtype and in float32), and names its
tiers with the digest a fresh reader takes from the files alone. Its meaning holds: the same weights
in another directory or sharded otherwise give the same digest, one changed value another."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch
from hf_checkpoints import write_checkpoint
from safetensors.torch import load_file, save_file

from pdserve.config import load_config
from pdserve.engine.engine import LLMEngine
from pdserve.engine.tier_identity import tier_namespace
from pdserve.model.hf_files import HFWeights


def _start(path, tier_dir, monkeypatch, **more) -> Counter:
    """Starts an engine on `path` with a disk tier in `tier_dir`; the bytes read of each stored tensor."""
    read: Counter = Counter()
    real = HFWeights._read

    def counted(self, name, *where):  # the real read, its bytes counted
        t = real(self, name, *where)
        read[name] += t.numel() * t.element_size()
        return t

    monkeypatch.setattr(HFWeights, "_read", counted)
    config = load_config(
        overrides={
            "model.name": str(path),
            "cache.device_blocks": 16,
            "cache.disk_cache_dir": str(tier_dir),
            "cache.disk_cache_gb": 0.01,
            **more,
        }
    )
    engine = LLMEngine(config)
    engine.close()
    monkeypatch.undo()
    return read


@pytest.mark.parametrize(
    "family,layout", [("llama", "experts"), ("qwen3_moe", "experts"), ("mixtral", "fused")]
)
def test_start_up_reads_the_checkpoint_once_and_names_the_tiers_by_its_digest(
    tmp_path, monkeypatch, family, layout
):
    path = tmp_path / "ckpt"
    write_checkpoint(path, family, layout)
    read = _start(path, tmp_path / "tier", monkeypatch, **{"model.quantization": "int8"})
    stored = HFWeights.open(path)
    index = {n: stored.stored(n) for n in stored}
    twice = {n for n, b in read.items() if b > index[n].nbytes}
    assert set(read) == set(index)  # every tensor read, experts included
    assert all(b % index[n].nbytes == 0 for n, b in read.items())  # whole, by expert or by rows
    assert twice <= {n for n in index if n.endswith(".gate.weight")}  # the routers only
    assert sum(read.values()) - sum(read[n] for n in twice) / 2 == stored.stored_nbytes
    # The tiers' namespace: the digest of a reader that has read nothing, sampled from the files.
    config = load_config(overrides={"model.name": str(path), "model.quantization": "int8"})
    want = tier_namespace(config, 256, HFWeights.open(path).digest())
    assert [p.name for p in (tmp_path / "tier").iterdir()] == [want]


def test_the_digest_names_the_weights_not_their_files(tmp_path):
    a = tmp_path / "a"
    write_checkpoint(a, "qwen3_moe", fp8=True)
    base = HFWeights.open(a).digest()
    shutil.copytree(a, tmp_path / "elsewhere")
    assert HFWeights.open(tmp_path / "elsewhere").digest() == base
    write_checkpoint(tmp_path / "resharded", "qwen3_moe", fp8=True, shards=3)
    assert HFWeights.open(tmp_path / "resharded").digest() == base
    # The digest of what a build read equals the one sampled from the files.
    read = HFWeights.open(a)
    for name in read:
        read[name]
    assert read.digest() == base
    # One changed value (an FP8 expert's first element) gives another digest, as another seed does.
    changed = tmp_path / "changed"
    shutil.copytree(a, changed)
    for f in sorted(changed.glob("*.safetensors")):
        tensors = load_file(str(f))
        name = next(
            (n for n in sorted(tensors) if ".experts.3.up_proj.weight" in n and "scale" not in n), None
        )
        if name is not None:
            t = tensors[name]
            t.view(torch.uint8).view(-1)[0] ^= 1
            save_file(tensors, str(f))
            break
    assert HFWeights.open(changed).digest() != base
    write_checkpoint(tmp_path / "other", "qwen3_moe", fp8=True, seed=1)
    assert HFWeights.open(tmp_path / "other").digest() != base
