"""Incremental text and stop strings against the whole-text decode of a real byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from magicpig_jax.io.tokenizer import Tokenizer
from magicpig_jax.streaming import StopStrings, TextStream, check_stop_strings

FAMILY = Path(__file__).parent / "fixtures" / "families" / "qwen2"
TEXT = "Héllo wörld, 你好 🎉🎉 naïve — done. STOP here"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_hf_dir(FAMILY)


def test_pieces_are_whole_characters_and_join_to_the_text(tok):
    ids = tok.encode(TEXT)
    assert len(ids) > len(TEXT.encode()) // 4  # multi-byte characters span several tokens
    stream = TextStream(tok.decode)
    pieces = [stream.push(ids[:n]) for n in range(1, len(ids) + 1)]
    pieces.append(stream.push(ids, final=True))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == TEXT


def test_stop_string_is_cut_and_never_streamed(tok):
    ids = tok.encode(TEXT)
    stop = StopStrings(tok.decode, ["STOP"])
    first = next(n for n in range(1, len(ids) + 1) if stop(0, ids[:n]))
    assert "STOP" in tok.decode(ids[:first]) and "STOP" not in tok.decode(ids[:first - 1])
    stream = TextStream(tok.decode, ["STOP"])
    pieces = [stream.push(ids[:n]) for n in range(1, first + 1)] + [stream.push(ids[:first], final=True)]
    assert "".join(pieces) == stop.cut(tok.decode(ids[:first])) == TEXT[:TEXT.index("STOP")]


def test_stop_strings_are_checked():
    assert check_stop_strings(None) == () and check_stop_strings("x") == ("x",)
    with pytest.raises(ValueError, match="non-empty"):
        check_stop_strings(["a", ""])
    # bytes that are not UTF-8 reach Python as lone surrogates: decoded text never holds them
    with pytest.raises(ValueError, match="lone surrogate"):
        check_stop_strings(["a\udcff"])
    with pytest.raises(TypeError, match="stop must be"):
        check_stop_strings([1])
