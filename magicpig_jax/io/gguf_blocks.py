"""The GGUF block formats that the decode-time matvec reads from the file as they are.

Facts only (pure Python, no kernel): the loader keeps the raw blocks of the matrices stored
in these types, and :mod:`magicpig_jax.host.matvec` multiplies by them. Block formats
(ggml ``ggml-common.h``; each row of ``In`` weights is ``In / 32`` blocks):

* ``Q4_1``, 20 bytes: f16 ``d``, f16 ``m``, 16 bytes of 4-bit ``q``;
  ``w[j] = d * q[j] + m`` (low nibbles are weights 0..15, high nibbles 16..31);
* ``Q8_0``, 34 bytes: f16 ``d``, 32 int8 ``q``; ``w[j] = d * q[j]``.
"""

from __future__ import annotations

__all__ = ["QUANT_TYPES", "BLOCK_SIZE", "block_bytes", "packed_row_bytes"]

BLOCK_SIZE = 32  # weights per block (QK4_1 == QK8_0 == 32)
QUANT_TYPES = {"Q4_1": (3, 20), "Q8_0": (8, 34)}  # name -> (ggml_type id, bytes per block)


def block_bytes(qtype: str) -> int:
    """Bytes per block of 32 weights of a supported GGUF type.

    Raises:
      ValueError: ``qtype`` is not one of :data:`QUANT_TYPES` (``"Q4_1"``, ``"Q8_0"``).
    """
    if qtype not in QUANT_TYPES:
        raise ValueError(f"qtype must be one of {sorted(QUANT_TYPES)}, got {qtype!r}")
    return QUANT_TYPES[qtype][1]


def packed_row_bytes(qtype: str, in_features: int) -> int:
    """Bytes of one packed row of ``in_features`` weights: ``in_features / 32 * block_bytes``.

    Raises:
      ValueError: unknown ``qtype``, or ``in_features`` not a positive multiple of 32.
    """
    bb = block_bytes(qtype)
    if not isinstance(in_features, int) or in_features <= 0 or in_features % BLOCK_SIZE:
        raise ValueError(f"in_features must be a positive multiple of {BLOCK_SIZE}, got {in_features!r}")
    return in_features // BLOCK_SIZE * bb
