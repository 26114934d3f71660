from __future__ import annotations

from pdserve.common.detokenizer import IncrementalDetokenizer
from pdserve.model.loader import default_gguf_path, load_gguf_tokenizer


def _tok():
    return load_gguf_tokenizer(str(default_gguf_path()))


def test_incremental_text_equals_full_decode_with_multibyte_chars():
    tok = _tok()
    text = "naïve café: 日本語のテキスト 🙂 and more"
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, True, [], False)
    pieces = []
    for t in ids:
        d.add(t)
        pieces.append(d.take(False))
    pieces.append(d.take(True))
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_truncates_and_is_never_streamed():
    tok = _tok()
    ids = tok.encode("Hello there. STOP here and beyond")
    d = IncrementalDetokenizer(tok, True, ["STOP"], False)
    streamed, hit = "", None
    for t in ids:
        hit = d.add(t)
        if hit:
            break
        streamed += d.take(False)
    assert hit == "STOP"
    streamed += d.take(True)
    assert streamed == "Hello there. "
    d2 = IncrementalDetokenizer(tok, True, ["STOP"], True)
    for t in ids:
        if d2.add(t):
            break
    assert d2.take(True) == "Hello there. STOP"
