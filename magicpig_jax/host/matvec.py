"""Decode-time matrix-vector products straight from GGUF-quantized weights (XLA FFI, CPU).

Decoding one token multiplies every weight matrix by one activation vector, so its cost is
the bytes of the weights read per token: 540 MB for a float32 copy of SmolLM2-135M, 96 MB
for the blocks of its GGUF file (Q4_1 projections, a Q8_0 embedding). The C++ handler
``magicpig_quant_matvec`` (``host_ops/quant_matvec.cc``) reads those blocks and dequantizes
them in registers, in float32, exactly as ggml's ``dequantize_row_q4_1``/``_q8_0`` (and
``gguf.quants.dequantize``) do; the activations stay float32 (llama.cpp rounds them to 8
bits). The product therefore equals ``x @ dequantize(w).T`` up to float32 summation order.

The block formats and their sizes are in :mod:`magicpig_jax.io.gguf_blocks` (re-exported here).

Work is split over rows with XLA's intra-op thread pool; the inner loop has an AVX2/FMA/F16C
variant chosen at run time and a portable scalar one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt8

from magicpig_jax.host._ext import impl_code, ops
from magicpig_jax.io.gguf_blocks import BLOCK_SIZE, QUANT_TYPES, block_bytes, packed_row_bytes

__all__ = ["QUANT_TYPES", "BLOCK_SIZE", "block_bytes", "packed_row_bytes", "quant_matvec"]


def quant_matvec(
    x: Float[Array, "*M In"],
    packed: UInt8[Array, "Out RB"],
    qtype: str,
    *,
    impl: str = "auto",
    max_threads: int = 0,
) -> Float[Array, "*M Out"]:
    """``x @ W.T`` for a GGUF-quantized ``W`` ``[Out, In]`` given as its packed rows.

    Meant for decoding (few rows ``M``): the weights are read once per call, each row against
    every activation vector.

    Args:
      x: float activations ``[..., In]`` (computed in float32; the result has ``x``'s dtype).
      packed: uint8 ``[Out, In / 32 * block_bytes(qtype)]``, the tensor's raw GGUF blocks, one
        row per output feature (``GGUFReader``'s ``tensor.data``).
      qtype: ``"Q4_1"`` or ``"Q8_0"``.
      impl: ``"auto"`` (AVX2 where the CPU has it), ``"scalar"`` or ``"avx2"``.
      max_threads: cap on pool threads (0: all of XLA's intra-op pool).

    Returns:
      ``[..., Out]``, equal to ``x @ gguf.quants.dequantize(packed, type).T`` up to float32
      summation order.

    Raises:
      ValueError: unknown ``qtype``/``impl``, ``In`` not a multiple of 32, or ``packed`` not of
        shape ``[Out, In / 32 * block_bytes]``.
      TypeError: ``packed`` is not uint8.
      ImportError: the native extension is not built.

    Source: ggml ``dequantize_row_q4_1`` / ``dequantize_row_q8_0`` (:mod:`magicpig_jax.io.gguf_blocks`).
    """
    code = impl_code(impl)
    x = jnp.asarray(x)
    packed = jnp.asarray(packed)
    if x.ndim < 1:
        raise ValueError(f"x must have at least one dimension [..., In], got shape {x.shape}")
    rb = packed_row_bytes(qtype, int(x.shape[-1]))
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be uint8 GGUF blocks, got {packed.dtype}")
    if packed.ndim != 2 or packed.shape[1] != rb:
        raise ValueError(f"packed must be uint8 [Out, {rb}] for {qtype} rows of In={x.shape[-1]}, "
                         f"got shape {packed.shape}")
    if not isinstance(max_threads, int) or max_threads < 0:
        raise ValueError(f"max_threads must be an int >= 0, got {max_threads!r}")
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
