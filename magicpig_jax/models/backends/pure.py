"""The pure-JAX entries: MagicPIG's reference, TopK / Quest / oracle sampling of the hashed range, hybrid."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from magicpig_jax.attention import (
    LSHIndex,
    budget_tokens,
    build_lsh_index,
    magicpig_attention,
    merge_attention,
    oracle_sampling_attention,
    quest_attention,
    static_attention,
    topk_attention,
)
from magicpig_jax.attention.baselines import quest_rows_read
from magicpig_jax.attention.hybrid import HybridConfig, hybrid_attention
from magicpig_jax.models.backends.spec import Backend, DecodeSpec, MiddleRange, layer_projections

# ------------------------------------------------------------------------------------------
# Pure-JAX MagicPIG.
# ------------------------------------------------------------------------------------------


def _build_reference(spec, k, lengths, layer, capacity):
    return build_lsh_index(k, layer_projections(spec.magicpig, layer, k.shape[-1]), spec.magicpig, lengths)


def _attend_reference(spec, q, k, v, state: LSHIndex, lengths, key):
    return magicpig_attention(q, k, v, state, spec.magicpig, lengths, softcap=spec.logit_softcap)


# ------------------------------------------------------------------------------------------
# TopK, Quest and oracle sampling of the hashed range, plus the exact static set.
# ------------------------------------------------------------------------------------------


def build_range(spec, k, lengths, layer, capacity):
    return MiddleRange.from_lengths(lengths, spec.magicpig)


def _attend_range(method: str, spec, q, k, v, state: MiddleRange, lengths, key):
    # A non-empty hashed range always starts at num_sink (start = min(num_sink, length) and
    # end > start only when length > num_sink), so the range is a static slice of the cache.
    s0 = min(spec.magicpig.num_sink, k.shape[2])
    mk, mv = k[:, :, s0:], v[:, :, s0:]
    mid_len = jnp.maximum(jnp.minimum(state.end, lengths) - s0, 0)
    cap = spec.logit_softcap
    if method == "topk":
        out, lse = topk_attention(q, mk, mv, spec.budget, mid_len, softcap=cap)
        used = jnp.minimum(budget_tokens(spec.budget, mid_len), mid_len)
    elif method == "quest":
        out, lse = quest_attention(q, mk, mv, spec.page_size, spec.budget, mid_len, softcap=cap)
        used = quest_rows_read(spec.budget, mid_len, spec.page_size)
    else:
        out, lse, used = oracle_sampling_attention(key, q, mk, mv, spec.budget, mid_len, softcap=cap)
    B, Hq = q.shape[:2]
    used = jnp.broadcast_to(used[:, None] if used.ndim == 1 else used, (B, Hq)).astype(jnp.int32)
    s_out, s_lse = static_attention(q, k, v, state.start, state.end, lengths, num_sink=spec.magicpig.num_sink,
                                    softcap=cap)
    out, lse = merge_attention(out, lse, s_out, s_lse)
    return out, lse, used


def _validate_hybrid(spec: DecodeSpec) -> None:
    configs = [spec.magicpig] if spec.layers is None else [spec.layers.config(i) for i in spec.layers.sparse_layers]
    for c in configs:
        if not isinstance(c, HybridConfig):
            raise ValueError(f"the 'hybrid' backend needs HybridConfig configurations (with 'heavy'), got {c!r}")


def _attend_hybrid(spec, q, k, v, state: LSHIndex, lengths, key):
    return hybrid_attention(q, k, v, state, spec.magicpig, lengths, softcap=spec.logit_softcap)


ENTRIES: dict[str, Backend] = {
    "magicpig-ref": Backend("magicpig-ref", build=_build_reference, attend=_attend_reference),
    "topk": Backend("topk", build=build_range, attend=functools.partial(_attend_range, "topk")),
    "quest": Backend("quest", build=build_range, attend=functools.partial(_attend_range, "quest")),
    "oracle": Backend("oracle", build=build_range, attend=functools.partial(_attend_range, "oracle")),
    "hybrid": Backend("hybrid (pure JAX)", build=_build_reference, attend=_attend_hybrid, validate=_validate_hybrid),
}
