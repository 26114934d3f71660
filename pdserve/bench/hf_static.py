"""The HF transformers baseline: `generate()` over static batches, timed per decoding step.

There is no server here: requests are taken C at a time, as a closed loop of C clients would
send them to a server that batches statically, and each batch runs to the end before the next.
A stopping criterion that never stops records the time of every step, so each request gets a
RequestRecord like the HTTP client's and the same metrics code summarises both.

Run as a child process (`python -m pdserve.bench.hf_static IN.json OUT.json`) so its thread count
is set before torch starts and the parent's load client does not share its interpreter.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def run(
    gguf: str, prompts: list[str], batch_size: int, max_new_tokens: int, threads: int, dtype: str = "float32"
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, StoppingCriteria, StoppingCriteriaList

    torch.set_num_threads(threads)
    path = Path(gguf)
    t_load = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=getattr(torch, dtype)
    ).eval()
    load_s = time.perf_counter() - t_load
    # Left padding keeps every row's last prompt token in the last column, where generation
    # continues from.
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    class StepClock(StoppingCriteria):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def gen(batch: list[str], n: int):
        enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False)
        clock = StepClock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            # min_new_tokens = max_new_tokens: every row generates exactly n tokens, the same
            # work the servers are asked for with ignore_eos.
            out = model.generate(
                **enc,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                stopping_criteria=StoppingCriteriaList([clock]),
                pad_token_id=tok.pad_token_id,
            )
        return enc, out, t0, time.perf_counter(), clock.times

    gen(prompts[:1], 4)  # warm-up: first-call allocations and lazy initialisation
    records = []
    for b in range(0, len(prompts), batch_size):
        batch = prompts[b : b + batch_size]
        enc, out, t0, t1, steps = gen(batch, max_new_tokens)
        new = out.shape[1] - enc["input_ids"].shape[1]
        for i in range(len(batch)):
            records.append(
                {
                    "id": str(b + i),
                    "start": t0,
                    "end": t1,
                    "chunk_times": steps[:new],
                    "prompt_tokens": int(enc["attention_mask"][i].sum()),
                    "completion_tokens": int(new),
                }
            )
    return {"records": records, "load_s": load_s, "threads": threads, "dtype": dtype}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    res = run(
        spec["gguf"],
        spec["prompts"],
        spec["batch_size"],
        spec["max_new_tokens"],
        spec["threads"],
        spec.get("dtype", "float32"),
    )
    Path(argv[1]).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
