"""A bias-free linear layer whose weight is either a float kernel or the GGUF file's own rows.

A weight loaded from a GGUF file in one of :data:`magicpig_jax.io.gguf_blocks.QUANT_TYPES`
(F16, BF16, Q4_0 .. Q8_0, Q4_K, Q5_K, Q6_K) is held once, as the file's raw rows
(:class:`PackedWeight`, uint8 ``[Out, RB]``); there is no float32 copy. Products read it:

* decode (at most :data:`MATVEC_MAX_TOKENS` token rows, CPU): :func:`magicpig_jax.host.matvec.quant_matvec`
  dequantizes each block in registers (the cost is the bytes of the weight);
* prefill (more rows, CPU): the rows are dequantized :data:`PREFILL_TILE_BYTES` of float32
  at a time by the C++ op and multiplied by XLA's GEMM, tile after tile (``PREFILL_MODE =
  "tiled"``), so the temporaries are bounded by the tile, not by the matrix; ``"layer"``
  dequantizes the whole matrix first (one layer's weights at a time);
* other backends, or an install without the extension: dequantized in JAX
  (:func:`magicpig_jax.models.dequant.dequantize`), then XLA's matmul.

Each equals ``x @ dequantize(W).T`` up to float32 summation order. A float kernel (Hugging
Face and float GGUF weights, ``load_model(..., packed_weights=False)``) uses XLA's float32
matmul. Shapes: ``[..., In] -> [..., Out]``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, UInt8

__all__ = ["Linear", "PackedWeight", "MATVEC_MAX_TOKENS", "PREFILL_MODE", "PREFILL_TILE_BYTES", "make_packed",
           "packed_matmul", "dense_matmul"]

MATVEC_MAX_TOKENS = 16  # token rows (B*T) up to which the C++ matvec reads the rows (a batch of 16 decodes)
PREFILL_MODE = "tiled"  # "tiled" or "layer": see the module docstring and docs/benchmarks.md
PREFILL_TILE_BYTES = 32 << 20  # float32 bytes of weights dequantized per tile ("tiled")


class PackedWeight(nnx.Variable):
    """Raw GGUF rows of a weight, uint8 ``[Out, In / block_weights * block_bytes]`` (not trainable)."""


def make_packed(blocks: np.ndarray | jax.Array, qtype: str, out_features: int, in_features: int) -> PackedWeight:
    """Validate the GGUF rows of an ``[Out, In]`` weight and wrap them as a :class:`PackedWeight`.

    Raises:
      ValueError: unknown ``qtype``, ``In`` not a multiple of the type's block, or ``blocks``
        not of shape ``[Out, In / block_weights * block_bytes(qtype)]``.
      TypeError: ``blocks`` is not uint8.
    """
    from magicpig_jax.io.gguf_blocks import packed_row_bytes

    rb = packed_row_bytes(qtype, in_features)
    if np.dtype(blocks.dtype) != np.uint8:
        raise TypeError(f"blocks must be uint8 GGUF blocks, got {blocks.dtype}")
    if tuple(blocks.shape) != (out_features, rb):
        raise ValueError(f"blocks must have shape {(out_features, rb)} for a {qtype} [{out_features}, "
                         f"{in_features}] weight, got {tuple(blocks.shape)}")
    return PackedWeight(jnp.asarray(blocks, jnp.uint8))


def _host_available() -> bool:
    try:
        from magicpig_jax.host._ext import ops

        ops()
    except ImportError:
        return False
    return True


def dense_matmul(x: Float[Array, "*M In"], w: jax.Array, *, transposed: bool) -> Float[Array, "*M Out"]:
    """``x @ W.T`` from a float weight: ``[In, Out]`` (``transposed=True``, a Flax kernel) or
    ``[Out, In]`` (``transposed=False``, e.g. an embedding table); HIGHEST precision."""
    eq = "...i,io->...o" if transposed else "...i,oi->...o"
    return jnp.einsum(eq, x, w.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)


def _jax_dequant_matmul(x, packed, qtype):
    from magicpig_jax.models.dequant import dequantize

    packed, x = jax.lax.optimization_barrier((packed, x))  # dequantize when x is ready, not earlier
    return dense_matmul(x, dequantize(packed, qtype).astype(x.dtype), transposed=False)


def _layer_matmul(x, packed, qtype):
    """The whole matrix dequantized by the C++ op (when ``x`` is ready), then XLA's GEMM."""
    from magicpig_jax.host.matvec import dequantize_rows

    packed, x = jax.lax.optimization_barrier((packed, x))
    return dense_matmul(x, dequantize_rows(packed, qtype).astype(x.dtype), transposed=False)


def _tile_rows(out_f: int, n_in: int, tile_bytes: int) -> int:
    """Rows per tile: the largest divisor of ``out_f`` that is a multiple of 8 and holds at most
    ``tile_bytes`` of float32 (so the tiles cover the matrix without slicing a copy of it);
    0 when there is none."""
    target = max(8, tile_bytes // (4 * n_in))
    best = 0
    for rows in range(8, min(out_f, target) + 1, 8):
        if out_f % rows == 0:
            best = rows
    return best


def _tiled_matmul(x, packed, qtype, tile_bytes: int):
    """Row tiles of the matrix dequantized by the C++ op and multiplied one after the other.

    The tiles are static slices, chained by optimization barriers (tile t + 1 is read once the
    product of tile t exists), so one tile's float32 rows are live at a time. (A ``lax.map``
    over the tiles made XLA copy every matrix into the loop's state: 1.5 GB of temporaries in
    an 8B model's prefill program, against 0.6 GB for whole matrices.)
    """
    from magicpig_jax.host.matvec import dequantize_rows
    from magicpig_jax.io.gguf_blocks import row_weights

    out_f = packed.shape[0]
    n_in = row_weights(qtype, int(packed.shape[1]))
    rows = _tile_rows(out_f, n_in, tile_bytes)
    if rows == 0 or rows == out_f:
        return _layer_matmul(x, packed, qtype)
    # Nothing derived from the weights is computed before x is ready (XLA would otherwise be
    # free to hoist every layer's work to the start of the program).
    packed, x = jax.lax.optimization_barrier((packed, x))
    lead = x.shape[:-1]
    x2 = x.reshape(-1, n_in)
    outs = []
    for t in range(out_f // rows):
        blk = packed[t * rows:(t + 1) * rows]
        if outs:
            blk, _ = jax.lax.optimization_barrier((blk, outs[-1]))
        outs.append(dense_matmul(x2, dequantize_rows(blk, qtype).astype(x.dtype), transposed=False))
    return jnp.concatenate(outs, axis=-1).reshape(*lead, out_f)


def packed_matmul(x: Float[Array, "*M In"], packed: UInt8[Array, "Out RB"], qtype: str) -> Float[Array, "*M Out"]:
    """``x @ W.T`` for a weight held as its GGUF rows (see the module docstring for the paths).

    Args:
      x: activations ``[..., In]``.
      packed: uint8 GGUF rows ``[Out, RB]``.
      qtype: their type (a key of :data:`magicpig_jax.io.gguf_blocks.QUANT_TYPES`).

    Returns:
      ``[..., Out]`` in ``x``'s dtype (float32 accumulation).

    Raises:
      TypeError: ``x`` is not floating-point (an int would be truncated, a complex lose its
        imaginary part).
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be floating-point (float32, bfloat16, float16), got {x.dtype}")
    if not _host_available():
        return _jax_dequant_matmul(x, packed, qtype)
    from magicpig_jax.host.matvec import quant_matvec

    def jax_path(x):
        return _jax_dequant_matmul(x, packed, qtype)

    if math.prod(x.shape[:-1]) <= MATVEC_MAX_TOKENS:
        def cpu(x):
            return quant_matvec(x, packed, qtype)
    elif PREFILL_MODE == "layer":
        def cpu(x):
            return _layer_matmul(x.astype(jnp.float32), packed, qtype).astype(x.dtype)
    else:
        def cpu(x):
            return _tiled_matmul(x.astype(jnp.float32), packed, qtype, PREFILL_TILE_BYTES).astype(x.dtype)
    # Only the branch of the platform being compiled for is lowered: on GPU/TPU the
    # CPU-only FFI targets are never referenced.
    return jax.lax.platform_dependent(x, cpu=cpu, default=jax_path)


class Linear(nnx.Module):
    """``y = x @ W.T`` (no bias), ``W`` held as a float ``kernel`` or as GGUF rows (``packed``).

    Args:
      in_features, out_features: In and Out.
      rngs: initialisation of ``kernel`` (LeCun normal; real weights are loaded over it).
      dtype: parameter dtype.

    Attributes:
      kernel: ``nnx.Param`` ``[In, Out]``, or None when the weight is held as GGUF rows (or
        its rows live in a matrix its parent stacked, see ``Attention.set_qkv_packed``).
      packed: :class:`PackedWeight` uint8 ``[Out, RB]`` or None; set with :meth:`set_packed`.
      qtype: the GGUF type of ``packed`` or None.

    Source: the float32 path matches ``flax.nnx.Linear`` (``precision=HIGHEST``, no bias).
    """

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.in_features, self.out_features = in_features, out_features
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (in_features, out_features), dtype))
        self.packed: PackedWeight | None = nnx.data(None)
        self.qtype: str | None = None

    def set_packed(self, blocks: np.ndarray | jax.Array | None, qtype: str | None) -> None:
        """Hold the weight as its GGUF rows from now on (the float kernel is dropped).

        With ``blocks=None`` the layer holds no weight at all (its rows were stacked into a
        matrix of its parent, which computes the product).

        Args:
          blocks: uint8 ``[Out, In / block_weights * block_bytes(qtype)]``, or None.
          qtype: a key of :data:`magicpig_jax.io.gguf_blocks.QUANT_TYPES`.

        Raises:
          ValueError: unknown ``qtype`` or a shape that does not match ``[Out, RB]``.
          TypeError: ``blocks`` is not uint8.
        """
        if blocks is None:
            self.packed, self.qtype = nnx.data(None), None
        else:
            self.packed = nnx.data(make_packed(blocks, qtype, self.out_features, self.in_features))
            self.qtype = qtype
        self.kernel = nnx.data(None)

    def __call__(self, x: Float[Array, "*M In"]) -> Float[Array, "*M Out"]:
        """``x @ W.T`` in ``x``'s dtype (float32 accumulation), from the GGUF rows or the kernel.

        Raises:
          ValueError: the layer's rows were stacked into its parent's matrix (it holds none).
          TypeError: ``x`` is not floating-point (GGUF rows).
        """
        if self.packed is not None:
            return packed_matmul(x, self.packed[...], self.qtype)
        if self.kernel is None:
            raise ValueError("this layer holds no weight: its rows were stacked into its parent's matrix")
        return dense_matmul(x, self.kernel[...], transposed=True)
