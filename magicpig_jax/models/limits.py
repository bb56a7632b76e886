"""What a model configuration may hold: the position limit, and the error for what is not implemented."""

from __future__ import annotations

__all__ = ["MAX_POSITIONS", "UnsupportedConfigError"]

MAX_POSITIONS = 2**31 - 1  # positions are int32 in the decoder and the host ops


class UnsupportedConfigError(ValueError):
    """A checkpoint declares an architecture, field or value this package does not implement."""
