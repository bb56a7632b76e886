"""Text as it is generated: stop strings and incremental decoding that never splits a character.

Byte-level tokenizers emit a multi-byte UTF-8 character over several tokens; decoding the
ids so far then ends in U+FFFD until the character is complete. A SentencePiece tokenizer
with byte fallback (``<0xF0>`` tokens; Hugging Face's ``ByteFallback`` decoder) decodes each
run of byte tokens as one piece, and a run that is not UTF-8 as a whole becomes one U+FFFD
per byte, characters of it that were already complete included: the text of a run can
change until a token that is not a byte token closes it. :class:`TextStream` emits only the
text that can no longer change, and holds back a tail that could still become a stop string,
so a streamed answer equals the final one piece by piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["check_stop_strings", "StopStrings", "TextStream"]

_REPLACEMENT = "\ufffd"


def check_stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings.

    Raises:
      TypeError: not a string or a sequence of strings.
      ValueError: an empty stop string, one holding a lone surrogate (bytes that were not
        UTF-8, which decoded text never contains), or one holding U+FFFD (which the text of a
        character still being completed ends in, so it would stop rows on valid text).
    """
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if any(s == "" for s in stop):
        raise ValueError("stop strings must be non-empty")
    if any("\ud800" <= c <= "\udfff" for s in stop for c in s):
        raise ValueError("stop strings must be valid Unicode text, got a lone surrogate (bytes that are not UTF-8)")
    if any(_REPLACEMENT in s for s in stop):
        raise ValueError("stop strings must not hold U+FFFD: the text of a character still being generated ends "
                         "in it, so such a stop string would end rows whose text is valid")
    return tuple(stop)


def check_stops_for(tokenizer, stops: Sequence[str]) -> None:
    """Refuse a stop string that holds a special token's text (``"<|im_start|>"``): the decoded
    text leaves a generated special token out, so it would not stop where the token is generated;
    it would match only the same characters spelled by ordinary tokens, which is seldom what was
    meant. Rows stop at the model's end-of-generation tokens without a stop string.

    Raises:
      ValueError: naming the stop string and the special token.
    """
    for s in stops:
        for token in getattr(tokenizer, "special_tokens", ()):
            if token and token in s:
                raise ValueError(f"stop string {s!r} holds the special token {token!r}, which decoded text leaves "
                                 "out: it would not stop where the model generates that token (only where the same "
                                 "characters are spelled by ordinary tokens); rows stop at the model's "
                                 "end-of-generation tokens without a stop string")


class StopStrings:
    """The stop criterion of the decode loop for stop strings (``stop(row, ids) -> bool``).

    A row stops once its decoded text contains any stop string; :meth:`cut` then gives the
    text before the first occurrence (the stop string itself is not part of the answer).
    The whole text is decoded each step (as :class:`TextStream` does): the text of a tail of the
    ids is not a suffix of it when the tail starts inside a run of byte-fallback tokens (one
    U+FFFD per byte) or at a token whose leading space a decoder strips, so a stop string
    completed there was missed and the row ran to its token limit.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str]):
        self.decode, self.stop = decode, tuple(stop)

    def __call__(self, row: int, ids: Sequence[int]) -> bool:
        """Whether the text of ``ids`` (a row's tokens so far) holds a stop string (``row`` is
        unused: every row has the same stop strings)."""
        text = self.decode(ids)
        return any(s in text for s in self.stop)

    def cut(self, text: str) -> str:
        """``text`` up to the first stop string (all of it if none occurs)."""
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return text[:min(hits)] if hits else text


class TextStream:
    """Incremental text of one row: :meth:`push` the ids so far, get the new final text.

    Args:
      decode: ids -> text (special tokens skipped).
      stop: stop strings; text that could still be the start of one is held back.
      partial: token id -> whether a later token can still change its text at the end of a
        text (:meth:`magicpig_jax.io.tokenizer.Tokenizer.partial_token`: byte-fallback tokens
        and parts of characters); the text of a trailing run of them is held back. Default:
        a token whose own text holds U+FFFD, which misses byte-fallback tokens of ASCII bytes.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (),
                 partial: Callable[[int], bool] | None = None):
        self.decode, self.stop = decode, tuple(stop)
        self.sent = 0
        self._partial = partial if partial is not None else (lambda i: _REPLACEMENT in self.decode([i]))

    def _open_tail(self, ids: Sequence[int]) -> int:
        """Where the trailing run of tokens that are parts of characters starts (``len(ids)``
        if the last token is whole): the text of that run can still change (module docstring)."""
        j = len(ids)
        while j and self._partial(int(ids[j - 1])):
            j -= 1
        return j

    def _safe_end(self, text: str, final: bool) -> int:
        end = len(text)
        if not final:
            while end and text[end - 1] == _REPLACEMENT:  # an incomplete character
                end -= 1
            for s in self.stop:  # a suffix that is a prefix of a stop string may still grow into it
                for k in range(min(len(s) - 1, end), 0, -1):
                    if text[end - k:end] == s[:k]:
                        end -= k
                        break
        return end

    def push(self, ids: Sequence[int], final: bool = False) -> str:
        """The text of ``ids`` not yet returned that can no longer change (all of it when ``final``)."""
        text = self.decode(ids)
        if self.stop:
            text = StopStrings(self.decode, self.stop).cut(text)
        end = self._safe_end(text, final)
        if not final:
            j = self._open_tail(ids)
            if j < len(ids):  # nothing past the text of the tokens before the open run
                head = self.decode(ids[:j])
                end = min(end, len(head) if text.startswith(head) else 0)
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent:end], end
        return piece
