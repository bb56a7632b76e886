"""The host index of one layer: the :class:`HostIndex` pytree, its chunk geometry and its bytes.

Layout per (row b, KV head h), capacity ``C = NC * CH`` positions cut into ``NC`` chunks of
``CH <= 65535`` consecutive positions (chunk c covers ``[c*CH, (c+1)*CH)``):

* ``ids`` uint16 ``[B, Hkv, NC, L, CH]``: per chunk and table, the chunk-relative
  token ids sorted by bucket (arXiv 2410.16179, Section 4.3);
* ``offsets`` uint16 ``[B, Hkv, NC, L, 2^K + 1]``: bucket starts (end = next start;
  the last entry is the number of tokens in the chunk, at most ``CH``, so 16 bits hold it);
* ``open_codes`` uint16 ``[B, Hkv, L, OPEN]``: codes of the open chunk, the most
  recently appended ``<= OPEN`` keys, scanned linearly by code comparison; when it is
  full, the next append merges it into the sorted chunks (amortized O(L) per key);
* ``bounds`` int32 ``[B, 3]``: ``(start, end, sealed_end)``; the hashed range is
  ``[start, end)``, ``[start, sealed_end)`` sits in the sorted chunks and
  ``[sealed_end, end)`` in the open chunk.

Bytes per token per KV head: ``2 L`` (ids) + ``2 L (2^K + 1) / CH`` (offsets)
+ ``2 L OPEN / C``; at K=10, L=150, C=128K (three chunks of 43,691), OPEN=512: 300 + 7.0 + 1.2 = 308 B, i.e. 0.60x the
512 B of bf16 K+V at D=128 (the reference's int32 layout: 600 B, 1.17x).

Everything here is plain JAX: no compiled extension is needed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jaxtyping import Array, Float, Int, UInt16

__all__ = [
    "HostIndex",
    "index_nbytes",
    "chunk_geometry",
    "HOST_MAX_K",
    "HOST_MAX_L",
    "MAX_CHUNK",
    "DEFAULT_OPEN_CAPACITY",
]

HOST_MAX_K = 16  # bucket offsets are 2^K + 1 uint16 per chunk and table
HOST_MAX_L = 4096
MAX_CHUNK = 65535  # uint16 token ids and bucket offsets (a full chunk's count is CH)
DEFAULT_OPEN_CAPACITY = 512


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["ids", "offsets", "open_codes", "bounds", "mean", "projections"],
    meta_fields=["K", "L", "num_sink", "num_local"],
)
@dataclasses.dataclass
class HostIndex:
    """MagicPIG's hash tables of one layer in host memory (a pytree of XLA buffers).

    Attributes:
      ids: uint16 ``[B, Hkv, NC, L, CH]`` token ids within each chunk, sorted by bucket.
      offsets: uint16 ``[B, Hkv, NC, L, 2^K + 1]`` bucket starts per chunk and table.
      open_codes: uint16 ``[B, Hkv, L, OPEN]`` codes of the open (unsorted) chunk.
      bounds: int32 ``[B, 3]``: (start, end, sealed_end) of the hashed range.
      mean: float32 ``[B, Hkv, D]``, the centering mean (arXiv 2410.16179, Section 4.2).
      projections: float32 ``[D, K*L]``, the SimHash hyperplanes.
      K, L: static LSH parameters.
      num_sink, num_local: static, the static set the index was built with
        (:func:`~magicpig_jax.host.build.host_build_index` records them; the attention refuses a
        config that differs, whose sinks or window would otherwise be dropped). None: not
        recorded (an index assembled by hand).

    See the module docstring for the layout and its memory cost.
    """

    ids: UInt16[Array, "B Hkv NC L CH"]
    offsets: UInt16[Array, "B Hkv NC L NB"]
    open_codes: UInt16[Array, "B Hkv L OPEN"]
    bounds: Int[Array, "B 3"]
    mean: Float[Array, "B Hkv D"]
    projections: Float[Array, "D KL"]
    K: int
    L: int
    num_sink: int | None = None
    num_local: int | None = None

    @property
    def start(self) -> jax.Array:
        """int32 ``[B]``: first hashed position."""
        return self.bounds[:, 0]

    @property
    def end(self) -> jax.Array:
        """int32 ``[B]``: one past the last hashed position (grows with appends)."""
        return self.bounds[:, 1]

    @property
    def capacity(self) -> int:
        """Positions the index can hold (``NC * CH``)."""
        return int(self.ids.shape[2] * self.ids.shape[4])

    @property
    def open_capacity(self) -> int:
        """Size of the open chunk."""
        return int(self.open_codes.shape[3])


def index_nbytes(index: HostIndex, include_mean: bool = False) -> int:
    """Bytes of the index buffers (ids + offsets + open chunk + bounds; optionally mean and projections)."""
    n = index.ids.nbytes + index.offsets.nbytes + index.open_codes.nbytes + index.bounds.nbytes
    if include_mean:
        n += index.mean.nbytes + index.projections.nbytes
    return int(n)


def chunk_geometry(capacity: int, chunk_size: int | None = None) -> tuple[int, int]:
    """``(NC, CH)``: chunks covering ``capacity`` positions.

    By default the fewest chunks of ``<= 65535`` positions, balanced; ``chunk_size``
    forces ``CH`` (tests use small chunks to exercise chunk boundaries).
    """
    if chunk_size is not None:
        return -(-capacity // chunk_size), chunk_size
    if capacity <= 0:
        return 0, 1
    nc = -(-capacity // MAX_CHUNK)
    return nc, -(-capacity // nc)
