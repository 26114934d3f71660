"""Shared fixtures. The real default model and the HF reference load once per session."""

from __future__ import annotations

import os
import sys

# Before torch loads: spinning OpenMP threads collapse on 2 shared cores (see MEASURED.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm_files():
    from pdserve.model.loader import load_model_files

    return load_model_files("smollm2-135m")


@pytest.fixture(scope="session")
def smollm_llm(smollm_files):
    """The offline engine on the real default model in float32 (quantization none, not the default auto,
    which serves the file's Q4_1 as int4): the engine HF's float32 reference is compared with."""
    from pdserve import LLM

    return LLM(model="smollm2-135m", loaded=smollm_files, quantization="none")


@pytest.fixture(scope="session")
def hf_reference():
    """HF transformers' own GGUF loader: an independent check of our dequantize + un-permute."""
    import torch
    from transformers import AutoModelForCausalLM

    from pdserve.model.loader import default_gguf_path

    path = default_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(autouse=True)
def _row_count_paths_after_each_test():
    """model.batch_invariant is the process's (qgemm.invariant_rows): an engine with speculative
    decoding turns it on; the next test starts with the row-count paths again."""
    yield
    qgemm = sys.modules.get("pdserve.model.kernels.qgemm")
    if qgemm is not None and qgemm.invariant_bound():
        qgemm.invariant_rows(0)
