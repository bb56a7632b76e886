"""Incremental text and stop strings against the whole-text decode of real tokenizers: byte-level
(qwen2) and SentencePiece with byte fallback (mistral, gemma2, phi3)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magicpig_jax.io.tokenizer import Tokenizer
from magicpig_jax.streaming import StopStrings, TextStream, check_stop_strings

FAMILIES = Path(__file__).parent / "fixtures" / "families"
FAMILY = FAMILIES / "qwen2"
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


@pytest.fixture(scope="module")
def byte_fallback():
    return {name: Tokenizer.from_hf_dir(FAMILIES / name) for name in ("mistral", "gemma2", "phi3")}


def test_a_byte_fallback_run_is_streamed_as_the_final_text(byte_fallback):
    # A run of <0xNN> tokens decodes as one UTF-8 piece: cut two bytes into the second emoji, the
    # whole run (the complete first emoji too) becomes U+FFFD per byte. The first emoji was streamed
    # before, and the stream then differed from .text.
    for tok in byte_fallback.values():
        ids = tok.encode("Hi \U0001F98A\U0001F98A")[:-2]
        assert tok.partial_token(ids[-1]) and not tok.partial_token(tok.encode("Hi")[-1])
        stream = TextStream(tok.decode, partial=tok.partial_token)
        pieces = [stream.push(ids[:n]) for n in range(1, len(ids) + 1)] + [stream.push(ids, final=True)]
        assert "".join(pieces) == tok.decode(ids) == "Hi " + "\ufffd" * 6


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_streamed_pieces_join_to_the_final_text(tok, byte_fallback, data):
    name = data.draw(st.sampled_from(["qwen2", "mistral", "gemma2", "phi3"]))
    t = tok if name == "qwen2" else byte_fallback[name]
    ids = data.draw(st.lists(st.integers(0, t.backend.get_vocab_size() - 1), min_size=1, max_size=30))
    full = t.decode(ids)
    stops = [full[len(full) // 2:len(full) // 2 + 2]] if data.draw(st.booleans()) and len(full) > 3 else []
    stops = [s for s in stops if s and "\ufffd" not in s]
    criterion = StopStrings(t.decode, stops) if stops else None
    stream = TextStream(t.decode, stops, t.partial_token)
    pieces, used = [], len(ids)
    for n in range(1, len(ids) + 1):
        pieces.append(stream.push(ids[:n]))
        # whatever was streamed is final: a prefix of the whole text so far (cut at a stop string)
        so_far = criterion.cut(t.decode(ids[:n])) if criterion else t.decode(ids[:n])
        assert so_far.startswith("".join(pieces)), (name, ids[:n])
        if criterion and criterion(0, ids[:n]):
            used = n
            break
        if not stops and not t.partial_token(ids[n - 1]):
            # nothing withheld past what can still change: after a whole token, all of the text
            # but an incomplete character's U+FFFD has been streamed
            assert "".join(pieces) == so_far.rstrip("\ufffd"), (name, ids[:n])
    pieces.append(stream.push(ids[:used], final=True))
    final = t.decode(ids[:used])
    assert "".join(pieces) == (criterion.cut(final) if criterion else final)
    if criterion:  # the criterion fires where the whole text first holds a stop string, never before
        assert any(s in final for s in stops)
        assert used == 1 or not any(s in t.decode(ids[:used - 1]) for s in stops)


def test_words_of_byte_tokens_stream_word_by_word(byte_fallback):
    # Korean words are "▁" + <0xNN> tokens here. "▁" alone decodes to "" (its space stripped) but
    # ends a byte run: it was taken for a skipped special token, and nothing streamed until the end.
    text = "Answer: 안녕 하세요 세계 여러분 반갑 습니다"
    for tok in byte_fallback.values():
        ids = tok.encode(text)
        stream = TextStream(tok.decode, partial=tok.partial_token)
        pieces = [stream.push(ids[:n]) for n in range(1, len(ids) + 1)]
        assert "".join(pieces).startswith("Answer: 안녕 하세요 세계 여러분 반갑"), "".join(pieces)
        assert "".join(pieces) + stream.push(ids, final=True) == tok.decode(ids)


def test_the_criterion_confirms_a_tail_hit_on_the_whole_text(byte_fallback):
    tok = byte_fallback["mistral"]
    byte = {tok.backend.id_to_token(i): i for i in range(tok.backend.get_vocab_size())}
    # <0xC3> then nine <0x41> ("A"): the run is not UTF-8 as a whole, so the text is ten U+FFFD,
    # while the last eight ids alone decode to "AAAAAAAA"
    ids = [byte["<0xC3>"]] + [byte["<0x41>"]] * 9
    assert tok.decode(ids) == "\ufffd" * 10 and tok.decode(ids[-8:]) == "A" * 8
    assert not StopStrings(tok.decode, ["A"])(0, ids)
    with pytest.raises(ValueError, match="must not hold U\\+FFFD"):
        check_stop_strings(["a\ufffd"])


@pytest.mark.parametrize("gap", [0, 5, 11, 12, 40])
def test_a_stop_string_across_tokens_without_text(tok, gap):
    """Skipped special tokens (and ids past the tokenizer's vocabulary) have no text: a stop string
    split by a run of them is still found, as in the whole text."""
    ell, end = tok.encode("l")[0], tok.backend.token_to_id("<|im_end|>")
    assert tok.decode([end]) == ""
    ids = [ell] + [end] * gap + [ell]
    stop = StopStrings(tok.decode, ["ll"])
    assert "ll" in tok.decode(ids) and stop(0, ids)
    assert not stop(0, ids[:-1])


def test_a_stop_string_completed_inside_a_byte_fallback_run_stops_the_row(byte_fallback):
    """The criterion decoded only a tail of the ids: a tail starting inside a run of byte tokens
    decodes to U+FFFD per byte, so an emoji stop string completed there was never seen and the row
    ran to its token limit; a tail starting at '▁License' lost its space to the decoder's Strip."""
    tok = byte_fallback["mistral"]
    byte = {tok.backend.id_to_token(i): i for i in range(tok.backend.get_vocab_size())}

    def spelled(text):
        return [byte[f"<0x{b:02X}>"] for b in text.encode()]

    ids = tok.encode("Party") + spelled("中é🎉") + spelled("中é") + [tok.backend.token_to_id("▁the")]
    stop = StopStrings(tok.decode, ["🎉"])
    first = next(n for n in range(1, len(ids) + 1) if "🎉" in tok.decode(ids[:n]))
    # (a byte run decodes as one piece: while a later character of it is incomplete the whole run,
    # the emoji included, is U+FFFD, so the row must stop at the step that completes it)
    assert first > 8 and not stop(0, ids[:first - 1]) and stop(0, ids[:first]) and stop(0, ids)
    unk, lic = tok.backend.token_to_id("<unk>"), tok.backend.token_to_id("▁License")
    ids = tok.encode("a") + [unk] * 11 + [lic]
    assert " L" in tok.decode(ids) and StopStrings(tok.decode, [" L"])(0, ids)
