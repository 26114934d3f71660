"""common/gguf_file.py against gguf-py's own reader on a file gguf-py wrote (every metadata value
type, string and nested arrays, float and quantized tensors), and loader.dequantize against
gguf.quants bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from pdserve.common.gguf_file import GGUFFile, GGUFFormatError  # noqa: E402
from pdserve.model.loader import dequantize  # noqa: E402

Q = gguf.GGMLQuantizationType


def _write(path, rng) -> dict[str, np.ndarray]:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("t.u32", 7)
    w.add_int32("t.i32", -7)
    w.add_uint8("t.u8", 255)
    w.add_int8("t.i8", -128)
    w.add_uint16("t.u16", 65535)
    w.add_int16("t.i16", -2)
    w.add_uint64("t.u64", 1 << 40)
    w.add_int64("t.i64", -(1 << 40))
    w.add_float32("t.f32", 0.1)
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo ✓")
    w.add_array("t.strings", ["", "a b", "Ġthe", "✓✓"])
    w.add_array("t.ints", [3, 1, 4, 1, 5])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.empty", [])
    w.add_array("t.nested", [[1, 2], [3]])
    tensors = {
        "f32": rng.standard_normal((3, 64)).astype(np.float32),
        "f16": rng.standard_normal((2, 5, 64)).astype(np.float16),
        "q4_0": rng.standard_normal((6, 96)).astype(np.float32),
        "q4_1": rng.standard_normal((4, 2, 64)).astype(np.float32),
        "q8_0": rng.standard_normal((5, 128)).astype(np.float32),
        "bf16": rng.standard_normal((2, 32)).astype(np.float32),
    }
    for name, a in tensors.items():
        kind = {"f32": None, "f16": None}.get(name, getattr(Q, name.upper()))
        if kind is None:
            w.add_tensor(name, a)
        else:
            w.add_tensor(name, gguf.quants.quantize(a, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_fields_and_tensors_read_as_gguf_py_reads_them(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, np.random.default_rng(0))
    ref = gguf.GGUFReader(str(path))
    want = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    with GGUFFile(path) as gf:
        # gguf-py's contents() flattens an array of arrays; here it keeps its nesting.
        assert {k: v for k, v in gf.fields.items() if k != "t.nested"} == {
            k: v for k, v in want.items() if k != "t.nested"
        }
        assert gf.fields["t.str"] == "héllo ✓" and gf.fields["t.nested"] == [[1, 2], [3]]
        got = gf.tensors()
        assert [t.name for t in got] == [t.name for t in ref.tensors]
        for t, r in zip(got, ref.tensors):
            assert t.tensor_type == r.tensor_type and list(t.shape) == list(r.shape), t.name
            assert t.data.shape == r.data.shape and t.data.dtype == r.data.dtype, t.name
            assert np.array_equal(t.data.view(np.uint8), r.data.view(np.uint8)), t.name
        del got, t
    header = GGUFFile(path, arrays=False)
    assert header.fields["t.strings"] == 4 and header.fields["t.ints"] == 5 and header.fields["t.nested"] == 2
    assert header.fields["t.str"] == "héllo ✓"
    assert [(t.name, t.type_id) for t in header.tensor_infos] == [
        (t.name, int(t.tensor_type)) for t in ref.tensors
    ]


def test_dequantize_gives_gguf_quants_bits(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, np.random.default_rng(1))
    for t in GGUFFile(path).tensors():
        got = dequantize(t)
        want = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        assert got.dtype == np.float32 and got.shape == want.shape, t.name
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name


def test_a_bad_file_is_refused_with_its_reason(tmp_path):
    path = tmp_path / "m.gguf"
    _write(path, np.random.default_rng(2))
    data = path.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        GGUFFile(bad)
    bad.write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(GGUFFormatError, match="version 9"):
        GGUFFile(bad)
    bad.write_bytes(data[:200])
    with pytest.raises(GGUFFormatError, match="past the end"):
        GGUFFile(bad)
    header_end = GGUFFile(path).data_offset
    bad.write_bytes(data[: header_end + 64])  # the tensor table whole, the tensors cut short
    with pytest.raises(GGUFFormatError, match="runs past the end of the file"):
        GGUFFile(bad).tensors()


def test_the_tokenizer_cache_round_trips_and_an_unwritable_cache_only_costs_the_build(tmp_path, monkeypatch):
    from pdserve.common.tokenizer import default_gguf_path, gguf_tokenizer

    path = str(default_gguf_path())
    text = "Hello world, 12345 <|im_start|>user\nhé ✓"
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    built = gguf_tokenizer(path)  # a miss: built from the file's lists, then written
    assert len(list((tmp_path / "cache" / "tokenizers").glob("*.json"))) == 2
    cached = gguf_tokenizer(path)  # a hit: read back
    for tok in (built, cached):
        assert tok.encode(text) == built.encode(text)
        assert tok.decode(built.encode("hé ✓ 12345")) == "hé ✓ 12345"  # special tokens are left out
    assert (cached.bos_token_id, cached.eos_token_ids, cached.add_bos, cached.chat_template) == (
        built.bos_token_id,
        built.eos_token_ids,
        built.add_bos,
        built.chat_template,
    )
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_CACHE", str(blocker / "cache"))  # no directory can be made there
    assert gguf_tokenizer(path).encode(text) == built.encode(text)
