"""The GGUF tensor types whose rows the model keeps and reads as the file stores them.

Facts only (pure Python, no kernel): the loader keeps the raw rows of every matrix stored
in one of these types (no float32 copy), :mod:`magicpig_jax.host.matvec` multiplies by
them on the CPU, and :mod:`magicpig_jax.models.dequant` dequantizes them in JAX. A row of
``In`` weights is ``In / block_weights`` consecutive blocks. Block formats (ggml
``ggml-common.h``; ``d``, ``m``, ``dmin`` are IEEE halves, little-endian):

* ``F16`` / ``BF16``: one 2-byte value per weight (a "block" of 1 weight).
* ``Q4_0``, 18 bytes: ``d``, 16 bytes of 4-bit ``q``; ``w = d * (q - 8)`` (the low nibble
  of byte ``j`` is weight ``j``, its high nibble weight ``j + 16``).
* ``Q4_1``, 20 bytes: ``d``, ``m``, 16 bytes of ``q``; ``w = d * q + m``.
* ``Q5_0``, 22 bytes: ``d``, 4 bytes ``qh`` (bit ``j`` is the fifth bit of weight ``j``),
  16 bytes of nibbles as Q4_0; ``w = d * (q - 16)``.
* ``Q5_1``, 24 bytes: ``d``, ``m``, ``qh``, nibbles; ``w = d * q + m``.
* ``Q8_0``, 34 bytes: ``d``, 32 int8 ``q``; ``w = d * q``.
* ``Q4_K``, 144 bytes per 256 weights: ``d``, ``dmin``, 12 bytes of 6-bit scales and mins
  of the 8 sub-blocks of 32, 128 bytes of nibbles (bytes ``32g..32g+31`` hold sub-block
  ``2g`` in their low nibbles and ``2g + 1`` in their high ones);
  ``w = (d * sc) * q - dmin * m``.
* ``Q5_K``, 176 bytes: as Q4_K plus 32 bytes ``qh`` before the nibbles (bit ``i`` of
  ``qh[l]`` is the fifth bit of weight ``l`` of sub-block ``i``).
* ``Q6_K``, 210 bytes: 128 bytes of low nibbles, 64 bytes of 2-bit high parts, 16 int8
  scales (one per 16 weights), then ``d``; ``w = (d * sc) * (q - 32)``.

The float32 arithmetic of each formula (its order of operations) is gguf-py's
``gguf.quants.dequantize``, which the kernels and their tests follow.
"""

from __future__ import annotations

import numpy as np

__all__ = ["QUANT_TYPES", "BLOCK_SIZE", "block_bytes", "block_weights", "packed_row_bytes", "row_weights"]

BLOCK_SIZE = 32  # weights per block of the legacy types (Q4_0 .. Q8_0); K-quants have 256
# name -> (ggml_type id, bytes per block, weights per block)
QUANT_TYPES = {
    "F16": (1, 2, 1),
    "Q4_0": (2, 18, 32),
    "Q4_1": (3, 20, 32),
    "Q5_0": (6, 22, 32),
    "Q5_1": (7, 24, 32),
    "Q8_0": (8, 34, 32),
    "Q4_K": (12, 144, 256),
    "Q5_K": (13, 176, 256),
    "Q6_K": (14, 210, 256),
    "BF16": (30, 2, 1),
}


def _check(qtype: str) -> tuple[int, int, int]:
    if not isinstance(qtype, str) or qtype not in QUANT_TYPES:  # an unhashable one raised TypeError
        raise ValueError(f"qtype must be one of {sorted(QUANT_TYPES)}, got {qtype!r}")
    return QUANT_TYPES[qtype]


def block_bytes(qtype: str) -> int:
    """Bytes per block of a supported GGUF type.

    Raises:
      ValueError: ``qtype`` is not one of :data:`QUANT_TYPES`.
    """
    return _check(qtype)[1]


def block_weights(qtype: str) -> int:
    """Weights per block of a supported GGUF type (1, 32 or 256).

    Raises:
      ValueError: ``qtype`` is not one of :data:`QUANT_TYPES`.
    """
    return _check(qtype)[2]


def packed_row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one packed row of ``in_features`` weights: ``in_features / block_weights * block_bytes``.

    Raises:
      ValueError: unknown ``qtype``, or ``in_features`` not a positive multiple of the block.
    """
    _, bb, bw = _check(qtype)
    if not _is_int(in_features) or in_features <= 0 or in_features % bw:
        raise ValueError(f"in_features must be a positive multiple of {bw} for {qtype}, got {in_features!r}")
    return int(in_features) // bw * bb


def _is_int(x) -> bool:
    """A Python or NumPy integer, not a bool."""
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def row_weights(qtype: str, row_bytes: int) -> int:
    """Weights in a packed row of ``row_bytes`` bytes (the inverse of :func:`packed_row_bytes`).

    Raises:
      ValueError: unknown ``qtype``, or ``row_bytes`` not a positive multiple of the block bytes.
    """
    _, bb, bw = _check(qtype)
    if not _is_int(row_bytes) or row_bytes <= 0 or row_bytes % bb:
        raise ValueError(f"a packed {qtype} row must be a positive multiple of {bb} bytes, got {row_bytes!r}")
    return int(row_bytes) // bb * bw
