"""Decode attention backends of the Llama decoder: one function per method, same static set.

Every sparse backend keeps the static set exact — the first ``num_sink`` tokens,
the last ``num_local`` prompt tokens and every generated token — and applies its
method to the middle range ``[start, end)`` fixed after prefill (the range
MagicPIG hashes), so the methods are compared like for like
(arXiv 2410.16179, Section 5).

Backends:
  dense         exact attention over every cached key.
  magicpig      LSH sampling; on the CPU backend the index and the sampled attention run
                in the host op (:mod:`magicpig_jax.host`), elsewhere the pure-JAX path.
  magicpig-ref  LSH sampling, pure-JAX reference (:func:`magicpig_attention`).
  topk       exact TopK of the middle range (``budget`` keys).
  quest      Quest page selection in the middle range (``budget`` keys, ``page_size`` pages).
  oracle     oracle sampling (Def. 3.1) of ``budget`` draws from the middle range.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from magicpig_jax.attention import (
    MagicPIGConfig,
    budget_tokens,
    dense_attention,
    magicpig_attention,
    merge_attention,
    oracle_sampling_attention,
    quest_attention,
    topk_attention,
)
from magicpig_jax.attention._common import check_lengths

__all__ = ["BACKENDS", "BUDGETED", "DecodeSpec", "MiddleRange", "sparse_attention"]

BACKENDS = ("dense", "magicpig", "magicpig-ref", "topk", "quest", "oracle")
BUDGETED = ("topk", "quest", "oracle")


@dataclasses.dataclass(frozen=True)
class DecodeSpec:
    """Static description of the decode attention (hashable; a jit static argument).

    Attributes:
      backend: one of :data:`BACKENDS`.
      magicpig: the :class:`MagicPIGConfig`; its ``num_sink``/``num_local`` define the
        static set of every sparse backend, K/L/seed are MagicPIG's.
      dense_layers: layer indices kept dense under a sparse backend (exact attention: in
        the host op :func:`magicpig_jax.host_exact.host_exact_attention` when ``uses_host``
        and no mesh, else :func:`dense_attention` in XLA).
      budget: keys per query head for "topk"/"quest"/"oracle": an ``int`` token count
        or a ``float`` in (0, 1], a fraction of the middle range.
      page_size: Quest's page size (tokens).
      generation_buffer: (host op) generated tokens stay static until more than
        ``num_local + 2 * generation_buffer`` positions follow the index; then the
        oldest ``generation_buffer`` of them are appended to the index in one call.
      host: whether "magicpig" runs through the host op (default: iff JAX's default
        backend is the CPU).

    Raises:
      ValueError: unknown backend, or a budgeted backend without a budget.
    """

    backend: str = "dense"
    magicpig: MagicPIGConfig = MagicPIGConfig()
    dense_layers: tuple[int, ...] = ()
    budget: int | float | None = None
    page_size: int = 16
    generation_buffer: int = 256
    host: bool | None = None
    mesh: object = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"attention backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend in BUDGETED and self.budget is None:
            raise ValueError(f"attention backend {self.backend!r} needs a budget (tokens or a fraction)")
        if self.generation_buffer < 1:
            raise ValueError(f"generation_buffer must be >= 1, got {self.generation_buffer}")
        if self.host is None:
            object.__setattr__(self, "host", self.backend == "magicpig" and jax.default_backend() == "cpu")
        if self.host:
            from magicpig_jax.host import _check_config

            _check_config(self.magicpig)

    @property
    def uses_host(self) -> bool:
        """True when the sparse layers run through the host op."""
        return bool(self.host) and self.backend == "magicpig"

    @property
    def static_window(self) -> int:
        """Tail positions the host path attends exactly in JAX (local window + 2 buffers)."""
        return self.magicpig.num_local + 2 * self.generation_buffer

    def sparse_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers that use the sparse backend (all but ``dense_layers``; none for "dense")."""
        if self.backend == "dense":
            return ()
        return tuple(i for i in range(num_layers) if i not in set(self.dense_layers))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MiddleRange:
    """The non-static range ``[start, end)`` of each row, fixed after prefill (int32 ``[B]`` each)."""

    start: jax.Array
    end: jax.Array

    @classmethod
    def from_lengths(cls, lengths: jax.Array, config: MagicPIGConfig) -> MiddleRange:
        """``start = min(num_sink, length)``, ``end = max(length - num_local, start)``."""
        start = jnp.minimum(jnp.int32(config.num_sink), lengths)
        return cls(start=start, end=jnp.maximum(lengths - jnp.int32(config.num_local), start))


def _shift_rows(x: jax.Array, start: jax.Array) -> jax.Array:
    """Roll each row of ``x`` ``[B, Hkv, N, D]`` left by ``start[b]`` positions."""
    return jax.vmap(lambda xb, s: jnp.roll(xb, -s, axis=1))(x, start)


def _static_part(q, k, v, rng: MiddleRange, lengths):
    """Dense attention over the static keys: ``[0, start)`` and ``[end, lengths)``."""
    out_a, lse_a = dense_attention(q, k, v, rng.start)
    shifted_k, shifted_v = _shift_rows(k, rng.end), _shift_rows(v, rng.end)
    out_b, lse_b = dense_attention(q, shifted_k, shifted_v, jnp.maximum(lengths - rng.end, 0))
    return merge_attention(out_a, lse_a, out_b, lse_b)


def sparse_attention(spec: DecodeSpec, q, k, v, state, lengths, key):
    """One sparse backend's decode attention for one layer.

    Args:
      spec: the :class:`DecodeSpec` (backend other than "dense").
      q: ``[B, Hq, D]``; k, v: ``[B, Hkv, N, D]`` (the layer's cache);
      state: the layer's :class:`LSHIndex` ("magicpig-ref"), :class:`HostIndex`
        (host "magicpig") or :class:`MiddleRange` (the others).
      lengths: int32 ``[B]`` valid keys; key: PRNG key (oracle sampling).

    Returns:
      ``(out [B, Hq, D], lse [B, Hq], keys_used [B, Hq])``: keys_used counts the
      sampled (magicpig), selected (topk/quest) or distinct drawn (oracle) keys of
      the middle range.
    """
    B, N = k.shape[0], k.shape[2]
    lengths = check_lengths(lengths, B, N)
    if spec.uses_host:
        from magicpig_jax.host import host_magicpig_attention

        if spec.mesh is not None:
            from magicpig_jax.distributed import sharded_magicpig_attention

            return sharded_magicpig_attention(spec.mesh, q, k, v, state, spec.magicpig, lengths,
                                              static_window=spec.static_window)
        # On the CPU backend the op also attends the exact tail [end, length) (window 0): the
        # rows are in the same host memory, and a JAX slice of them costs more than the op.
        return host_magicpig_attention(q, k, v, state, spec.magicpig, lengths, static_window=0)
    if spec.backend in ("magicpig", "magicpig-ref"):
        return magicpig_attention(q, k, v, state, spec.magicpig, lengths)
    mid_len = jnp.minimum(state.end, lengths) - state.start
    mid_len = jnp.maximum(mid_len, 0)
    mk, mv = _shift_rows(k, state.start), _shift_rows(v, state.start)
    if spec.backend == "topk":
        out, lse = topk_attention(q, mk, mv, spec.budget, mid_len)
        used = jnp.minimum(budget_tokens(spec.budget, mid_len), mid_len)
    elif spec.backend == "quest":
        out, lse = quest_attention(q, mk, mv, spec.page_size, spec.budget, mid_len)
        used = jnp.minimum(budget_tokens(spec.budget, mid_len), mid_len)
    elif spec.backend == "oracle":
        out, lse, distinct = oracle_sampling_attention(key, q, mk, mv, spec.budget, mid_len)
        used = distinct
    else:
        raise ValueError(f"not a sparse backend: {spec.backend!r}")
    used = jnp.broadcast_to(used[:, None] if used.ndim == 1 else used, (B, q.shape[1])).astype(jnp.int32)
    s_out, s_lse = _static_part(q, k, v, state, lengths)
    out, lse = merge_attention(out, lse, s_out, s_lse)
    return out, lse, used


def host_append_due(spec: DecodeSpec, index, k_cache, lengths):
    """Append the oldest ``generation_buffer`` un-indexed keys to a host index when due.

    Due for row b when ``lengths[b] - end[b] >= num_local + 2 * generation_buffer``
    (``lengths`` counts the token written this step). Returns the updated index.
    """
    from magicpig_jax.host import host_append

    T = spec.generation_buffer
    end = index.end
    due = (lengths - end) >= spec.static_window
    N = k_cache.shape[2]

    def append(index):
        pos = jnp.clip(end[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :], 0, N - 1)
        k_new = jnp.take_along_axis(k_cache, pos[:, None, :, None], axis=2)
        if spec.mesh is not None:
            from magicpig_jax.distributed import sharded_append

            return sharded_append(spec.mesh, index, k_new, jnp.where(due, T, 0).astype(jnp.int32))
        return host_append(index, k_new, jnp.where(due, T, 0).astype(jnp.int32))

    # Hashing T keys costs T*D*K*L flops: only on the steps where some row is due.
    return jax.lax.cond(jnp.any(due), append, lambda index: index, index)
