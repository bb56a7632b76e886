"""Products with GGUF weights read as the file stores them, and their dequantization (XLA FFI, CPU).

Decoding one token multiplies every weight matrix by one activation vector, so its cost is
the bytes of the weights read per token: 540 MB for a float32 copy of SmolLM2-135M, 96 MB
for the rows of its GGUF file (Q4_1 projections, a Q8_0 embedding). The model keeps only
those rows (:mod:`magicpig_jax.models.linear`). The C++ handler ``magicpig_quant_matvec``
(``host_ops/quant_matvec.cc``) reads them and dequantizes each block in registers, in
float32, as ggml's ``dequantize_row_*`` (and ``gguf.quants.dequantize``) do; the
activations stay float32 (llama.cpp rounds them to 8 bits). The product therefore equals
``x @ dequantize(w).T`` up to float32 summation order. ``magicpig_dequantize`` writes the
float32 rows themselves, bit-equal to gguf-py's (but for the quiet bit of a signalling NaN
among F16 weights, which the AVX2 path's F16C conversion sets).

Types: F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (their layouts are in
:mod:`magicpig_jax.io.gguf_blocks`, re-exported here).

Work is split over rows with XLA's intra-op thread pool; the matvec's inner loop has an
AVX2/FMA/F16C variant per type, chosen at run time, and a portable scalar one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

from magicpig_jax.host._ext import impl_code, ops
from magicpig_jax.host.validate import check_pool_threads
from magicpig_jax.io.gguf_blocks import (
    BLOCK_SIZE,
    QUANT_TYPES,
    block_bytes,
    block_weights,
    packed_row_bytes,
    row_weights,
)

__all__ = ["QUANT_TYPES", "BLOCK_SIZE", "block_bytes", "block_weights", "packed_row_bytes", "row_weights",
           "quant_matvec", "dequantize_rows"]


def _check_threads(max_threads) -> None:
    check_pool_threads(max_threads)


def _check_floating(x, name: str = "x") -> None:
    # an int or bool x would be cast to float32 and the product cast back (truncated), a complex x
    # would lose its imaginary part: both silently
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be floating-point (float32, bfloat16, float16), got {x.dtype}")


def _check_packed(packed, qtype: str, in_features: int) -> int:
    rb = packed_row_bytes(qtype, in_features)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be uint8 GGUF rows, got {packed.dtype}")
    if packed.ndim != 2 or packed.shape[1] != rb:
        raise ValueError(f"packed must be uint8 [Out, {rb}] for {qtype} rows of In={in_features}, "
                         f"got shape {packed.shape}")
    return rb


def quant_matvec(
    x: Float[Array, "*M In"],
    packed: UInt8[Array, "Out RB"],
    qtype: str,
    *,
    impl: str = "auto",
    max_threads: int = 0,
) -> Float[Array, "*M Out"]:
    """``x @ W.T`` for a GGUF ``W`` ``[Out, In]`` given as its packed rows.

    Meant for decoding (few rows ``M``): the weights are read once per call, each row against
    every activation vector.

    Args:
      x: float activations ``[..., In]`` (computed in float32; the result has ``x``'s dtype).
      packed: uint8 ``[Out, In / block_weights * block_bytes]``, the tensor's raw GGUF rows
        (``GGUFReader``'s ``tensor.data`` viewed as bytes), one row per output feature.
      qtype: one of :data:`QUANT_TYPES` (``"Q4_K"``, ``"Q6_K"``, ``"Q8_0"``, ``"F16"``, ...).
      impl: ``"auto"`` (AVX2 where the CPU has it; for several token rows, the token-blocked
        kernels built with AVX-512VL's 32 vector registers where the CPU has those, the same
        instructions and results), ``"scalar"`` or ``"avx2"`` (AVX2's 16 registers only).
      max_threads: cap on pool threads (0: all of XLA's intra-op pool).

    Returns:
      ``[..., Out]``, equal to ``x @ gguf.quants.dequantize(packed, type).T`` up to float32
      summation order, for activations of magnitude above ``2**-102`` (about 2e-31): the AVX2
      Q4_1, Q4_K and Q6_K kernels scale ``x`` by up to ``2**-24`` (so that the nibbles need no
      shifts) and XLA's CPU threads flush the resulting subnormals to zero, so smaller activations
      (far below any model's, whose RMSNorm keeps them near 1) count as 0 (for BF16, whose weights
      can themselves be tiny or subnormal, any product ``w * x`` below ``2**-126`` counts as 0,
      and a subnormal weight as 0); and below about
      ``1e34``: the kernels apply a block's scale after summing ``q * x`` and its min as ``m * sum(x)``,
      so larger activations can overflow to ±inf, or NaN (``0 * inf``), where the exact product is
      finite. An infinite block scale gives ±inf where gguf-py's dequantization gives NaN (the
      kernels multiply the scale by a sum, not each weight), and an infinite activation may give NaN
      where it gives ±inf; the decode loop refuses non-finite logits either way.

    Raises:
      ValueError: unknown ``qtype``/``impl``, ``In`` not a multiple of the type's block, or
        ``packed`` not of shape ``[Out, In / block_weights * block_bytes]``.
      TypeError: ``packed`` is not uint8, or ``x`` is not floating-point.
      ImportError: the native extension is not built.

    Source: ggml ``dequantize_row_*`` (:mod:`magicpig_jax.io.gguf_blocks`).
    """
    code = impl_code(impl)
    x = jnp.asarray(x)
    packed = jnp.asarray(packed)
    if x.ndim < 1:
        raise ValueError(f"x must have at least one dimension [..., In], got shape {x.shape}")
    _check_floating(x)
    _check_packed(packed, qtype, int(x.shape[-1]))
    _check_threads(max_threads)
    ops()
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    y = jax.ffi.ffi_call(
        "magicpig_quant_matvec",
        jax.ShapeDtypeStruct((x2.shape[0], packed.shape[0]), jnp.float32),
        vmap_method="sequential",
    )(x2, packed, qtype=np.int64(QUANT_TYPES[qtype][0]), impl=np.int64(code),
      max_threads=np.int64(max_threads))
    return y.reshape(*lead, packed.shape[0]).astype(x.dtype)


def dequantize_rows(packed: UInt8[Array, "R RB"], qtype: str, *, impl: str = "auto",
                    max_threads: int = 0) -> Float[Array, "R In"]:
    """The float32 rows of packed GGUF rows, bit-equal to ``gguf.quants.dequantize``.

    Args:
      packed: uint8 ``[R, In / block_weights * block_bytes]``.
      qtype: one of :data:`QUANT_TYPES`.
      impl: ``"auto"`` (AVX2 where the CPU has it and the type has a vector path), ``"scalar"``
        or ``"avx2"``; every variant gives the same bits, but for a signalling NaN among F16
        weights, which AVX2's F16C conversion returns quiet (gguf-py and the scalar path keep it).
      max_threads: cap on pool threads (0: all of XLA's intra-op pool).

    Returns:
      float32 ``[R, In]``.

    Raises:
      ValueError: unknown ``qtype``, or a row width that is not a whole number of blocks.
      TypeError: ``packed`` is not uint8.
      ImportError: the native extension is not built.
    """
    code = impl_code(impl)
    packed = jnp.asarray(packed)
    if packed.ndim != 2:
        raise ValueError(f"packed must be uint8 [R, RB], got shape {packed.shape}")
    n_in = row_weights(qtype, int(packed.shape[1]))
    _check_packed(packed, qtype, n_in)
    _check_threads(max_threads)
    ops()
    return jax.ffi.ffi_call(
        "magicpig_dequantize",
        jax.ShapeDtypeStruct((packed.shape[0], n_in), jnp.float32),
        vmap_method="sequential",
    )(packed, qtype=np.int64(QUANT_TYPES[qtype][0]), impl=np.int64(code), max_threads=np.int64(max_threads))
