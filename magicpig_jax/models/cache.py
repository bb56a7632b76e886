"""The KV cache pytree: a static maximum length, per-row valid lengths."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from magicpig_jax.models.config import LlamaConfig

__all__ = ["KVCache", "RowBroadcast", "write_token"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Keys and values of every layer, as one pytree.

    Attributes:
      k, v: tuples of ``num_layers`` arrays ``[B, Hkv, Nmax, D]`` (RoPE applied to k).
      lengths: int32 ``[B]``, tokens cached per row (positions ``0 .. lengths[b]-1``).

    Nmax (the capacity) is static: decoding writes in place (the cache is donated
    to the jitted step, so no step copies it).
    """

    k: tuple[Float[Array, "B Hkv N D"], ...]
    v: tuple[Float[Array, "B Hkv N D"], ...]
    lengths: Int[Array, " B"]

    @classmethod
    def zeros(cls, config: LlamaConfig, batch: int, capacity: int, dtype=jnp.float32) -> KVCache:
        """An empty cache for ``batch`` rows and ``capacity`` positions.

        Raises:
          ValueError: non-positive batch or capacity.
        """
        if batch < 1 or capacity < 1:
            raise ValueError(f"batch and capacity must be >= 1, got batch={batch}, capacity={capacity}")
        shape = (batch, config.num_kv_heads, capacity, config.head_dim)
        k = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        v = tuple(jnp.zeros(shape, dtype) for _ in range(config.num_layers))
        return cls(k=k, v=v, lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def capacity(self) -> int:
        """Nmax, the static number of positions."""
        return self.k[0].shape[2]

    def copy(self) -> KVCache:
        """A copy whose buffers can be donated without invalidating this one."""
        return jax.tree.map(jnp.copy, self)

    def broadcast_rows(self, batch: int, row: int = 0) -> KVCache:
        """A new cache of ``batch`` rows, each a copy of row ``row`` of this one.

        One prefill shared by ``batch`` sequences (a benchmark of batched decoding, or several
        samples of one prompt): the rows then decode independently.

        Raises:
          ValueError: ``batch < 1`` or ``row`` outside ``[0, B)``.
        """
        B = self.lengths.shape[0]
        if batch < 1 or not 0 <= row < B:
            raise ValueError(f"need batch >= 1 and 0 <= row < {B}, got batch={batch}, row={row}")

        def rows(x):
            out = jnp.broadcast_to(x[row:row + 1], (batch, *x.shape[1:]))
            return jnp.copy(out) if batch == 1 else out  # never an alias of the source (it may be donated)

        return jax.tree.map(rows, self)


@dataclasses.dataclass(frozen=True)
class RowBroadcast:
    """A cache of ``batch`` identical rows that exists only as its source row until copied.

    A :class:`~magicpig_jax.generation.PrefillState` may hold it in place of a
    :class:`KVCache`: decoding starts from a copy of the prefill cache (:meth:`copy`), and
    here that copy is the broadcast itself, so B rows of one prefill cost one B-row cache,
    not two (at B = 16 and 8K tokens, SmolLM2's float32 cache is 6.2 GB).

    Attributes:
      source: the prefilled cache; batch: the number of rows it stands for; row: the row of
        ``source`` that every row copies.
    """

    source: KVCache
    batch: int
    row: int = 0

    @property
    def capacity(self) -> int:
        """Nmax of the source cache."""
        return self.source.capacity

    @property
    def lengths(self) -> jax.Array:
        """int32 ``[batch]``: the source row's length, for every row."""
        return jnp.full((self.batch,), self.source.lengths[self.row], jnp.int32)

    def copy(self) -> KVCache:
        """The ``batch``-row cache (:meth:`KVCache.broadcast_rows`)."""
        return self.source.broadcast_rows(self.batch, self.row)


def write_token(cache_layer: jax.Array, x: jax.Array, pos: jax.Array) -> jax.Array:
    """Write ``x`` ``[B, Hkv, D]`` at position ``pos[b]`` of each row of ``cache_layer`` ``[B, Hkv, N, D]``.

    A row with ``pos[b] >= N`` (full: one that stopped at the context while other rows decode on)
    is left as it is: ``dynamic_update_slice`` would clamp the write into its last slot.
    """
    N = cache_layer.shape[2]
    for b in range(x.shape[0]):
        update = x[b][None, :, None, :].astype(cache_layer.dtype)
        at = (b, 0, jnp.minimum(pos[b], N - 1), 0)
        update = jnp.where(pos[b] < N, update, jax.lax.dynamic_slice(cache_layer, at, update.shape))
        cache_layer = jax.lax.dynamic_update_slice(cache_layer, update, at)
    return cache_layer
