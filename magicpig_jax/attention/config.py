"""MagicPIG hyper-parameters (arXiv 2410.16179, Section 5 / Table 8 defaults)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from magicpig_jax.lsh import validate_k_l

__all__ = ["MagicPIGConfig", "GENERATION_BUFFER"]

# Generated tokens stay in the static set until ``GENERATION_BUFFER`` more follow them; then they
# are hashed into the index in one append (the reference keeps a generation buffer of 256 tokens,
# arXiv 2410.16179, Section 5). The unhashed tail ``[end, length)`` is therefore never longer than
# ``num_local + 2 * GENERATION_BUFFER`` positions: that bound is :meth:`MagicPIGConfig.static_window`.
GENERATION_BUFFER = 256
# The most sink or local tokens a configuration may keep: positions are int32, and the static
# window (num_local plus two generation buffers) must stay one.
MAX_STATIC_TOKENS = 2**29


def _check_count(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {name}={value}")


@dataclasses.dataclass(frozen=True)
class MagicPIGConfig:
    """Configuration of MagicPIG sampled attention.

    Attributes:
      K: SimHash bits per table, 1 <= K <= 32 (codes are uint32).
      L: number of hash tables, L >= 2; a key is sampled when its code equals the
        query's in at least 2 of the L tables.
      num_sink: sink tokens at the start of the context kept exactly (static set), in
        ``[0, 2**29]``.
      num_local: last prompt tokens (local window) kept exactly (static set), in ``[0, 2**29]``.
      seed: seed of the Gaussian SimHash projections, in ``[0, 2**32)`` (``jax.random.key`` keeps
        32 bits: a larger seed would silently repeat a smaller one's hyperplanes).
      layers_per_projection: consecutive layers that share one projection matrix, >= 1:
        layer ``i`` draws its hyperplanes from ``fold_in(key(seed), i // layers_per_projection)``.
        1 (the default) gives every layer its own matrix. Each layer's estimator only needs its
        own hyperplanes to be Gaussian and independent across tables, which sharing keeps; the
        MagicPIG reference implementation shares one matrix per 16 layers. On the host a shared
        matrix stays in the CPU caches across a decode step's layers instead of being read from
        memory once per layer (:func:`magicpig_jax.models.backends.projection_sources`).

    Defaults follow the paper: K=10, L=150 touches about 2% of the keys;
    4 sink tokens and a 64-token local window (arXiv 2410.16179, Section 5).

    Raises:
      TypeError: a field is not an int.
      ValueError: a field is out of range; the message names the field.
    """

    K: int = 10
    L: int = 150
    num_sink: int = 4
    num_local: int = 64
    seed: int = 0
    layers_per_projection: int = 1

    def __post_init__(self) -> None:
        validate_k_l(self.K, self.L)
        for name in ("num_sink", "num_local"):
            _check_count(name, getattr(self, name))
            if getattr(self, name) > MAX_STATIC_TOKENS:
                raise ValueError(f"{name} must be <= 2**29 (positions are int32), got {name}={getattr(self, name)}")
        _check_count("seed", self.seed)
        if self.seed >= 2**32:
            raise ValueError(f"seed must be < 2**32, got seed={self.seed}")
        n = self.layers_per_projection
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"layers_per_projection must be an int, got {type(n).__name__} {n!r}")
        if n < 1:
            raise ValueError(f"layers_per_projection must be >= 1, got {self.layers_per_projection}")

    def hashed_range(self, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The hashed range ``[start, end)`` of each row: the keys that are neither sinks nor local.

        ``start = min(num_sink, length)`` and ``end = max(length - num_local, start)``
        (arXiv 2410.16179, Section 5: the static set is the sinks plus the local window).

        Args:
          lengths: int ``[B]`` valid keys per row.

        Returns:
          ``(start, end)``, int32 ``[B]`` each, ``0 <= start <= end <= length``.

        Raises:
          TypeError: ``lengths`` not an integer array.
        """
        from magicpig_jax.attention._common import int32_clipped

        lengths = int32_clipped(lengths)  # a negative row holds no key; a uint32 3e9 cast first was negative
        start = jnp.minimum(jnp.int32(self.num_sink), lengths)
        return start, jnp.maximum(lengths - jnp.int32(self.num_local), start)

    def static_window(self, generation_buffer: int = GENERATION_BUFFER) -> int:
        """The longest unhashed tail ``[end, length)``: ``num_local + 2 * generation_buffer`` positions.

        The local window plus up to two generation buffers of decoded tokens that are not yet
        appended to the index (an append of ``generation_buffer`` keys is due once the tail
        reaches this length). Every decode path attends these positions exactly.
        """
        return self.num_local + 2 * generation_buffer
