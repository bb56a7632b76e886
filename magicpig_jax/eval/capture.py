"""Capture real decode-step q/k/v from a model on a real long prompt (for the attention study).

``magicpig-jax study attention --capture`` consumes what :func:`capture_qkv` returns.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from magicpig_jax.generation import prefill
from magicpig_jax.io.loader import LoadedModel, load_model
from magicpig_jax.models.decoding import decode_queries

__all__ = ["capture_qkv", "DEFAULT_TEXT", "main"]

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")


def capture_qkv(model: LoadedModel, text: str, max_tokens: int | None = None) -> dict[str, np.ndarray]:
    """Prefill ``text`` (raw, no chat template) and return the next decode step's q/k/v of every layer.

    Args:
      model: the loaded model.
      text: the prompt (its tokens are truncated to ``max_tokens`` if given).
      max_tokens: optional cap on the prompt length (tokens).

    Returns:
      dict with ``q`` float32 ``[layers, Hq, D]`` (the query of the token after the
      prompt, scaled so that ``q·k / sqrt(D)`` is the model's logit), ``k``, ``v`` float32
      ``[layers, Hkv, N, D]`` (the prompt's cached keys, RoPE applied, and values),
      ``num_tokens``, and ``attn_logit_softcap`` float32 ``[]``: the model's attention logit
      soft-capping c (Gemma 2), 0 for none; the study caps every estimator's logits with it.

    Raises:
      ValueError: an empty prompt or one longer than the model's context; a model whose sliding
        window is shorter than the prompt (its layers do not attend to every captured key, so the
        study would misread them), before the prefill.
    """
    ids = model.tokenizer.encode(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    binding = model.config.binding_windows(len(ids))
    if binding:
        raise ValueError(f"capture: layers {list(binding)} attend through a sliding window of "
                         f"{model.config.sliding_window} tokens, shorter than this prompt of {len(ids)}: the study "
                         "would attend to keys those layers never see (pass a shorter --max-tokens)")
    state = prefill(model, [ids], 1)
    graphdef, params = nnx.split(model.module)
    nxt = jnp.argmax(state.last_logits, -1).astype(jnp.int32)
    q = np.asarray(decode_queries(graphdef, params, state.cache, nxt))[:, 0]
    N = len(ids)
    k = np.stack([np.asarray(x[0, :, :N]) for x in state.cache.k])
    v = np.stack([np.asarray(x[0, :, :N]) for x in state.cache.v])
    return {"q": q, "k": k, "v": v, "num_tokens": np.int32(N),
            "attn_logit_softcap": np.float32(model.config.attn_logit_softcap or 0.0)}


def main(argv: list[str] | None = None) -> int:
    """``python -m magicpig_jax.eval.capture OUT.npz [--text FILE] [--model PATH] [--max-tokens N]``."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("out", type=Path)
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    a = p.parse_args(argv)
    data = capture_qkv(load_model(a.model), a.text.read_text(encoding="utf-8"), a.max_tokens)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(a.out, **data)
    print(f"wrote {a.out}: {int(data['num_tokens'])} tokens, q {data['q'].shape}, k {data['k'].shape}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
