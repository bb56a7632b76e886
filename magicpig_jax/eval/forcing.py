"""Teacher-forced decoding: feed given tokens and observe every step's logits.

The likelihood task scores a method by the logits it gives to a fixed continuation, so the
decode loop must take the next token from the text rather than from sampling, and hand each
step's logits to the evaluator. :func:`forced_decode` is public (calibrate and the notebooks use
it too); to generate, call :func:`magicpig_jax.generation.decode`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from magicpig_jax.decode_loop import DecodeHooks, Sampling, check_not_consumed, run_decode
from magicpig_jax.generation import decode_spec

__all__ = ["forced_decode"]


def forced_decode(model, state, *, forced_tokens: Sequence[Sequence[int]] | None = None,
                  logits_callback: Callable[[int, np.ndarray], None] | None = None, attention: str = "magicpig",
                  max_new_tokens: int = 64, config=None, dense_layers=None, budget=None, page_size: int = 16,
                  sampling: Sampling | None = None, stop_on_eos: bool = True,
                  progress=None, mesh=None, then_sample: bool = False, spec=None):
    """:func:`magicpig_jax.generation.decode` with teacher forcing and a per-step logits hook.

    Args:
      model, state: as for :func:`~magicpig_jax.generation.decode`.
      forced_tokens: B lists of at least ``max_new_tokens`` ids fed instead of the sampled
        ones (the returned ids are then these ids); None samples as usual. With ``stop_on_eos``
        (the default, as for decode) a row still stops at a forced stop id: to score a whole
        continuation that may hold one, pass ``stop_on_eos=False`` (what eval and calibrate do).
      logits_callback: ``callback(step, logits)`` receiving the float32 ``[B, V]`` NumPy
        logits that predict token ``step`` (step 0 = the prefill's).
      attention, max_new_tokens, config, dense_layers, budget, page_size, sampling, stop_on_eos,
        progress, mesh: as for :func:`~magicpig_jax.generation.decode`.
      then_sample: the forced ids are a prefix (rows may be shorter than ``max_new_tokens``): the
        tokens after it are sampled, EOS counts only there (a question decoded after a prefilled
        document, then its answer).
      spec: a ready :class:`~magicpig_jax.models.backends.DecodeSpec` instead of ``attention`` ..
        ``mesh`` (e.g. one with ``host=False``).

    Returns:
      ``(token_ids per row, stats dict)``, as :func:`~magicpig_jax.generation.decode`.

    Raises:
      ValueError: ``forced_tokens`` without one list of ``max_new_tokens`` ids per row, or with an
        id outside ``[0, vocab_size)``, and every error of :func:`~magicpig_jax.generation.decode`.
      TypeError: a forced id that is not an integer.
    """
    check_not_consumed(state)  # before reading state.cache (a consumed state or None: AttributeError)
    if spec is None:
        spec = decode_spec(model, attention, config, dense_layers, budget, page_size, mesh,
                           positions=state.cache.capacity)
    hooks = DecodeHooks(forced_tokens=forced_tokens, on_logits=logits_callback, then_sample=then_sample)
    return run_decode(model, state, spec, max_new_tokens, sampling or Sampling(), stop_on_eos=stop_on_eos,
                      progress=progress, hooks=hooks)
