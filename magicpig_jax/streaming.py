"""Text as it is generated: stop strings and incremental decoding that never splits a character.

Byte-level tokenizers emit a multi-byte UTF-8 character over several tokens; decoding the
ids so far then ends in U+FFFD until the character is complete. :class:`TextStream` emits
only the text that can no longer change, and holds back a tail that could still become a
stop string, so a streamed answer equals the final one piece by piece.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["check_stop_strings", "StopStrings", "TextStream"]

_REPLACEMENT = "\ufffd"


def check_stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """``stop`` as a tuple of non-empty strings.

    Raises:
      TypeError: not a string or a sequence of strings.
      ValueError: an empty stop string, or one holding a lone surrogate (bytes that were not
        UTF-8, which decoded text never contains).
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
    return tuple(stop)


def check_stops_for(tokenizer, stops: Sequence[str]) -> None:
    """Refuse a stop string that holds a special token's text (``"<|im_start|>"``): the decoded
    text leaves special tokens out, so it could never match.

    Raises:
      ValueError: naming the stop string and the special token.
    """
    for s in stops:
        for token in getattr(tokenizer, "special_tokens", ()):
            if token and token in s:
                raise ValueError(f"stop string {s!r} holds the special token {token!r}, which decoded text leaves "
                                 "out: it would never match (a row ends at the model's end-of-turn token anyway)")


class StopStrings:
    """The stop criterion of the decode loop for stop strings (``stop(row, ids) -> bool``).

    A row stops once its decoded text contains any stop string; :meth:`cut` then gives the
    text before the first occurrence (the stop string itself is not part of the answer).
    Only the tail of the ids that can hold a new occurrence is decoded each step.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str]):
        self.decode, self.stop = decode, tuple(stop)
        # A character takes at most 4 byte tokens, and a token at least one byte.
        self.tail = 4 * max((len(s) for s in self.stop), default=0) + 4

    def __call__(self, row: int, ids: Sequence[int]) -> bool:
        """Whether the text of ``ids`` (a row's tokens so far; only the last few are decoded) holds
        a stop string (``row`` is unused: every row has the same stop strings)."""
        text = self.decode(ids[-self.tail:])
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
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()):
        self.decode, self.stop = decode, tuple(stop)
        self.sent = 0

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
        if end <= self.sent:
            return ""
        piece, self.sent = text[self.sent:end], end
        return piece
