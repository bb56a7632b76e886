"""Teacher-forced decoding for evaluation: feed given tokens and observe every step's logits.

The likelihood task scores a method by the logits it gives to a fixed continuation, so the
decode loop must take the next token from the text rather than from sampling, and hand each
step's logits to the evaluator. These hooks are for evaluation only; users call
:func:`magicpig_jax.generation.decode`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from magicpig_jax.generation import decode

__all__ = ["forced_decode"]


def forced_decode(model, state, *, forced_tokens: Sequence[Sequence[int]] | None = None,
                  logits_callback: Callable[[int, np.ndarray], None] | None = None, **decode_kwargs):
    """:func:`magicpig_jax.generation.decode` with teacher forcing and a per-step logits hook.

    Args:
      model, state: as for :func:`~magicpig_jax.generation.decode`.
      forced_tokens: B lists of at least ``max_new_tokens`` ids fed instead of the sampled
        ones (the returned ids are then these ids); None samples as usual.
      logits_callback: ``callback(step, logits)`` receiving the float32 ``[B, V]`` NumPy
        logits that predict token ``step`` (step 0 = the prefill's).
      decode_kwargs: every other keyword of :func:`~magicpig_jax.generation.decode`.

    Returns:
      ``(token_ids per row, stats dict)``, as :func:`~magicpig_jax.generation.decode`.

    Raises:
      ValueError: ``forced_tokens`` without one list of ``max_new_tokens`` ids per row, and
        every error of :func:`~magicpig_jax.generation.decode`.
    """
    return decode(model, state, forced_tokens=forced_tokens, logits_callback=logits_callback, **decode_kwargs)
