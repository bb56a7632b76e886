"""The KV cache pytree: a static maximum length, per-row valid lengths."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from magicpig_jax.models.config import LlamaConfig

__all__ = ["KVCache"]


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
