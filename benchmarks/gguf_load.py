"""Loading the default model's GGUF file (SmolLM2-135M-Instruct, Q4_1): pdserve's loader against
gguf-py's reader and against Hugging Face transformers, each in a fresh process.

Timed in the child, after its imports (torch, gguf, transformers are not the load):
- `pdserve none`: loader.load_model_files("smollm2-135m", quantization="none"): the metadata,
  the tokenizer (its disk cache warm, as on every start after the first), every tensor dequantized
  to float32, as a worker serving `--quantization none` loads it;
- `pdserve int4`: the same with the Q4_1 tensors kept as stored (what `auto` serves);
- `gguf-py`: gguf.GGUFReader on the file, its metadata as Python values (contents()), every tensor
  through gguf.quants.dequantize to float32: the same work with the reference library;
- `transformers`: AutoModelForCausalLM.from_pretrained(dir, gguf_file=...) (float32), where
  transformers has its GGUF support (it reads the file with gguf-py).

Figure: gguf-py ÷ pdserve none and transformers ÷ pdserve none (medians of --rounds fresh
processes each, interleaved), higher is better. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from pdserve.common.tokenizer import default_gguf_path
from pdserve.utils.cpu import describe

_CHILD = {
    "pdserve none": """
from pdserve.model.loader import load_model_files
t = time.perf_counter(); m = load_model_files("smollm2-135m", 0, "none"); dt = time.perf_counter() - t
assert len(m.weights) > 100
""",
    "pdserve int4": """
from pdserve.model.loader import load_model_files
t = time.perf_counter(); m = load_model_files("smollm2-135m", 0, "int4"); dt = time.perf_counter() - t
assert len(m.weights) > 100
""",
    "gguf-py": """
import gguf, numpy as np
t = time.perf_counter()
r = gguf.GGUFReader(PATH)
fields = {k: f.contents() for k, f in r.fields.items()}
w = [gguf.quants.dequantize(x.data, x.tensor_type).astype(np.float32) for x in r.tensors]
dt = time.perf_counter() - t
assert len(fields["tokenizer.ggml.tokens"]) > 1000 and len(w) > 100
""",
    "transformers": """
import os, torch, transformers
d, f = os.path.split(PATH)
t = time.perf_counter()
m = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32)
dt = time.perf_counter() - t
""",
}


def run(kind: str, path: str) -> float | None:
    code = f"import json, time\nPATH = {path!r}\n" + _CHILD[kind] + "\nprint(json.dumps(dt))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        print(f"{kind}: failed: {out.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-transformers", action="store_true", help="leave transformers out (slow)")
    args = ap.parse_args()
    path = str(default_gguf_path())
    kinds = [k for k in _CHILD if not (args.no_transformers and k == "transformers")]
    times: dict[str, list[float]] = {k: [] for k in kinds}
    run("pdserve none", path)  # the tokenizer's disk cache filled, the file in the page cache
    for r in range(args.rounds):
        for k in kinds:
            dt = run(k, path)
            if dt is not None:
                times[k].append(dt)
                print(f"round {r + 1}: {k}: {dt:.2f} s", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in times.items() if v}
    ours = med.get("pdserve none")
    print(
        json.dumps(
            {
                "cpu": describe(),
                "seconds": {k: round(v, 3) for k, v in med.items()},
                "gguf_py_over_pdserve": round(med["gguf-py"] / ours, 2)
                if ours and "gguf-py" in med
                else None,
                "transformers_over_pdserve": (
                    round(med["transformers"] / ours, 2) if ours and "transformers" in med else None
                ),
            }
        )
    )


if __name__ == "__main__":
    main()
