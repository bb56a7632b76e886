"""GGUF rows to float32 in JAX, on any backend (the pure-JAX twin of ``magicpig_dequantize``).

The model keeps each matrix as its GGUF rows (:mod:`magicpig_jax.models.linear`). Where
the C++ op does not apply — the embedding gather (a few rows), backends other than the CPU,
an install without the extension — the rows are dequantized here, with gguf-py's float32
arithmetic in its order (``gguf.quants.dequantize``; layouts in
:mod:`magicpig_jax.io.gguf_blocks`).

Shapes: ``[..., RB]`` uint8 -> ``[..., In]`` float32, ``RB = In / block_weights * block_bytes``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, UInt8

from magicpig_jax.io.gguf_blocks import QUANT_TYPES, row_weights

__all__ = ["dequantize"]


def _f16(b: jax.Array) -> jax.Array:
    """Little-endian IEEE halves ``[..., 2]`` uint8 -> float32 ``[...]`` (exact)."""
    return jax.lax.bitcast_convert_type(b, jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array) -> jax.Array:
    """``[..., 16]`` bytes -> ``[..., 32]``: the low nibbles, then the high ones."""
    return jnp.concatenate([qs & 15, qs >> 4], axis=-1)


def _bits(b: jax.Array, n: int) -> jax.Array:
    """``[..., n/8]`` bytes -> ``[..., n]`` bits, little-endian (bit j of the LE word)."""
    shifts = jnp.arange(8, dtype=jnp.uint8)
    return ((b[..., :, None] >> shifts) & 1).reshape(*b.shape[:-1], n)


def _scale_min_k4(s: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 8 six-bit scales and mins of Q4_K / Q5_K from their 12 bytes (``[..., 12]``)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(jnp.float32), mn.astype(jnp.float32)


def _blocks(qtype: str, b: jax.Array) -> jax.Array:
    """Blocks ``[..., block_bytes]`` -> weights ``[..., block_weights]`` float32."""
    f32 = jnp.float32
    if qtype == "F16":
        return _f16(b)[..., None]
    if qtype == "BF16":
        bits = jax.lax.bitcast_convert_type(b, jnp.uint16).astype(jnp.uint32) << 16
        return jax.lax.bitcast_convert_type(bits, f32)[..., None]
    if qtype == "Q4_0":
        d = _f16(b[..., 0:2])[..., None]
        return d * (_nibbles(b[..., 2:18]).astype(jnp.int32) - 8).astype(f32)
    if qtype == "Q4_1":
        d, m = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        return d * _nibbles(b[..., 4:20]).astype(f32) + m
    if qtype in ("Q5_0", "Q5_1"):
        q51 = qtype == "Q5_1"
        qh_at, qs_at = (4, 8) if q51 else (2, 6)
        q = _nibbles(b[..., qs_at:qs_at + 16]) | (_bits(b[..., qh_at:qh_at + 4], 32) << 4)
        d = _f16(b[..., 0:2])[..., None]
        if q51:
            return d * q.astype(f32) + _f16(b[..., 2:4])[..., None]
        return d * (q.astype(jnp.int32) - 16).astype(f32)
    if qtype == "Q8_0":
        q = jax.lax.bitcast_convert_type(b[..., 2:34], jnp.int8).astype(f32)
        return q * _f16(b[..., 0:2])[..., None]
    if qtype in ("Q4_K", "Q5_K"):
        lead = b.shape[:-1]
        d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
        sc, mn = _scale_min_k4(b[..., 4:16])
        d1 = (d * sc)[..., None]                    # [..., 8, 1]
        m1 = (dmin * mn)[..., None]
        qs = b[..., 48:176] if qtype == "Q5_K" else b[..., 16:144]
        qs = qs.reshape(*lead, 4, 1, 32) >> jnp.array([0, 4], jnp.uint8).reshape(2, 1)
        q = (qs & 15).reshape(*lead, 8, 32)        # sub-block 2g: low nibbles, 2g + 1: high
        if qtype == "Q5_K":
            qh = b[..., 16:48].reshape(*lead, 1, 32) >> jnp.arange(8, dtype=jnp.uint8).reshape(8, 1)
            q = q | ((qh & 1) << 4)
        return (d1 * q.astype(f32) - m1).reshape(*lead, 256)
    if qtype == "Q6_K":
        lead = b.shape[:-1]
        ql = b[..., 0:128].reshape(*lead, 2, 1, 64) >> jnp.array([0, 4], jnp.uint8).reshape(2, 1)
        ql = (ql & 15).reshape(*lead, 8, 32)
        qh = b[..., 128:192].reshape(*lead, 2, 1, 32) >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)
        qh = (qh & 3).reshape(*lead, 8, 32)
        q = ((ql | (qh << 4)).astype(jnp.int32) - 32).astype(f32).reshape(*lead, 16, 16)
        sc = jax.lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(f32)
        d = (_f16(b[..., 208:210])[..., None] * sc)[..., None]  # [..., 16, 1]
        return (d * q).reshape(*lead, 256)
    raise ValueError(f"qtype must be one of {sorted(QUANT_TYPES)}, got {qtype!r}")


def dequantize(packed: UInt8[Array, "*R RB"], qtype: str) -> Float[Array, "*R In"]:
    """Float32 weights of packed GGUF rows, with gguf-py's arithmetic (``gguf.quants.dequantize``).

    Args:
      packed: uint8 ``[..., RB]``, whole blocks per row.
      qtype: one of :data:`magicpig_jax.io.gguf_blocks.QUANT_TYPES`.

    Returns:
      float32 ``[..., In]``.

    A signalling NaN among F16 weights comes back quiet (XLA's float16 conversion sets the quiet bit;
    gguf-py keeps it signalling); every other value is bit-equal.

    Raises:
      ValueError: unknown ``qtype``, ``packed`` of rank 0, or ``RB`` not a whole number of blocks.
      TypeError: ``packed`` is not uint8.
    """
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be uint8 GGUF rows, got {packed.dtype}")
    if packed.ndim == 0:
        raise ValueError("packed must have a last axis of packed bytes, got a scalar")
    n_in = row_weights(qtype, int(packed.shape[-1]))
    _, bb, _ = QUANT_TYPES[qtype]
    lead = packed.shape[:-1]
    blocks = packed.reshape(*lead, packed.shape[-1] // bb, bb)
    return _blocks(qtype, blocks).reshape(*lead, n_in)
