"""MagicPIG hyper-parameters (arXiv 2410.16179, Section 5 / Table 8 defaults)."""

from __future__ import annotations

import dataclasses

from magicpig_jax.lsh import validate_k_l

__all__ = ["MagicPIGConfig"]


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
      num_sink: sink tokens at the start of the context kept exactly (static set), >= 0.
      num_local: last prompt tokens (local window) kept exactly (static set), >= 0.
      seed: seed of the Gaussian SimHash projections (layer ``i`` folds ``i`` in), >= 0.

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

    def __post_init__(self) -> None:
        validate_k_l(self.K, self.L)
        _check_count("num_sink", self.num_sink)
        _check_count("num_local", self.num_local)
        _check_count("seed", self.seed)
