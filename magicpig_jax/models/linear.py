"""A bias-free linear layer that can also keep its weight as GGUF blocks for decoding.

Prefill multiplies a weight by hundreds of tokens at once (XLA's float32 GEMM on the
``kernel``); decoding multiplies it by one token per row, and then the cost is the bytes
of the weight. A :class:`Linear` loaded from a quantized GGUF file also holds the tensor's
raw blocks (:class:`PackedWeight`); calls with at most :data:`MATVEC_MAX_TOKENS` token rows
then use :func:`magicpig_jax.host.matvec.quant_matvec` on CPU, which reads those blocks
(6x fewer bytes than float32 for Q4_1) and equals the float32 product up to summation order.
On other backends, or without packed blocks, the float32 kernel is used.

Shapes: ``[..., In] -> [..., Out]``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float

__all__ = ["Linear", "PackedWeight", "MATVEC_MAX_TOKENS", "make_packed", "packed_matmul", "fused_matmul",
           "fuse_packed"]

MATVEC_MAX_TOKENS = 8  # token rows (B*T) up to which the packed weights are used


class PackedWeight(nnx.Variable):
    """Raw GGUF blocks of a weight, uint8 ``[Out, In / 32 * block_bytes]`` (not trainable)."""


def make_packed(blocks: np.ndarray | jax.Array, qtype: str, out_features: int, in_features: int) -> PackedWeight:
    """Validate GGUF blocks of an ``[Out, In]`` weight and wrap them as a :class:`PackedWeight`.

    Raises:
      ValueError: unknown ``qtype``, ``In`` not a multiple of 32, or ``blocks`` not of shape
        ``[Out, In / 32 * block_bytes(qtype)]``.
      TypeError: ``blocks`` is not uint8.
    """
    from magicpig_jax.host.matvec import packed_row_bytes

    rb = packed_row_bytes(qtype, in_features)
    if np.dtype(blocks.dtype) != np.uint8:
        raise TypeError(f"blocks must be uint8 GGUF blocks, got {blocks.dtype}")
    if tuple(blocks.shape) != (out_features, rb):
        raise ValueError(f"blocks must have shape {(out_features, rb)} for a {qtype} [{out_features}, "
                         f"{in_features}] weight, got {tuple(blocks.shape)}")
    return PackedWeight(jnp.asarray(blocks, jnp.uint8))


def _host_matvec_available() -> bool:
    try:
        from magicpig_jax.host._ext import ops

        ops()
    except ImportError:
        return False
    return True


def _packed_or_dense(x, packed, qtype, dense, post=lambda y: y):
    """``post(quant_matvec(x, packed))`` for decode-sized calls on CPU, else ``dense(x)``."""
    if packed is None or math.prod(x.shape[:-1]) > MATVEC_MAX_TOKENS or not _host_matvec_available():
        return dense(x)
    from magicpig_jax.host.matvec import quant_matvec

    # Only the branch of the platform being compiled for is lowered: on GPU/TPU the
    # CPU-only FFI target is never referenced.
    return jax.lax.platform_dependent(x, cpu=lambda x: post(quant_matvec(x, packed, qtype)), default=dense)


def packed_matmul(
    x: Float[Array, "*M In"],
    dense_weight: Float[Array, "Out In"] | Float[Array, "In Out"],
    packed: jax.Array | None,
    qtype: str | None,
    *,
    transposed: bool,
) -> Float[Array, "*M Out"]:
    """``x @ W.T`` from the packed blocks where they pay off, else from the float weight.

    Args:
      x: activations ``[..., In]``.
      dense_weight: the same weight in float, ``[In, Out]`` (``transposed=True``, a Flax
        kernel) or ``[Out, In]`` (``transposed=False``, e.g. a tied embedding table).
      packed: uint8 GGUF blocks ``[Out, RB]`` of the same weight, or None.
      qtype: the blocks' GGUF type (``"Q4_1"``/``"Q8_0"``), or None.
      transposed: the layout of ``dense_weight``.

    Returns:
      ``[..., Out]`` in ``x``'s dtype (float32 accumulation, HIGHEST precision).
    """
    def dense(x):
        eq = "...i,io->...o" if transposed else "...i,oi->...o"
        return jnp.einsum(eq, x, dense_weight.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)

    return _packed_or_dense(x, packed, qtype, dense)


def fused_matmul(
    x: Float[Array, "*M In"],
    kernels: list[jax.Array],
    packed: jax.Array | None,
    qtype: str | None,
) -> tuple[jax.Array, ...]:
    """``x @ kernel_i`` for several ``[In, Out_i]`` kernels that read the same input.

    Where the packed path applies (see :func:`packed_matmul`), one matvec reads ``packed``,
    the blocks of all the kernels' rows stacked (:func:`fuse_packed`), and its output is
    split; otherwise (prefill, other backends) each float32 kernel is applied on its own.

    Returns:
      one ``[..., Out_i]`` array per kernel, in ``x``'s dtype.
    """
    def dense(x):
        return tuple(jnp.einsum("...i,io->...o", x, k.astype(x.dtype), precision=jax.lax.Precision.HIGHEST)
                     for k in kernels)

    splits = np.cumsum([k.shape[1] for k in kernels])[:-1].tolist()
    return _packed_or_dense(x, packed, qtype, dense, post=lambda y: tuple(jnp.split(y, splits, axis=-1)))


def fuse_packed(linears: list[Linear]) -> tuple[PackedWeight | None, str | None]:
    """Stack the packed rows of layers that read the same input, for :func:`fused_matmul`.

    Returns ``(PackedWeight [sum Out_i, RB], qtype)`` when every layer has packed blocks of
    one type and the same ``In``; else ``(None, None)``. One call then replaces several on
    the decode path (about 1 ms per token for SmolLM2's q/k/v and gate/up on 2 cores).
    """
    first = linears[0]
    if any(lin.packed is None or lin.qtype != first.qtype or lin.in_features != first.in_features
           for lin in linears):
        return None, None
    return PackedWeight(jnp.concatenate([lin.packed[...] for lin in linears], axis=0)), first.qtype


class Linear(nnx.Module):
    """``y = x @ kernel`` (no bias), optionally with the weight's GGUF blocks for decoding.

    Args:
      in_features, out_features: In and Out.
      rngs: initialisation of ``kernel`` (LeCun normal; real weights are loaded over it).
      dtype: parameter dtype.

    Attributes:
      kernel: ``nnx.Param`` ``[In, Out]``.
      packed: :class:`PackedWeight` uint8 ``[Out, RB]`` or None; set with :meth:`set_packed`.
      qtype: the GGUF type of ``packed`` (``"Q4_1"`` or ``"Q8_0"``) or None.

    Source: the float32 path matches ``flax.nnx.Linear`` (``precision=HIGHEST``, no bias).
    """

    def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.in_features, self.out_features = in_features, out_features
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (in_features, out_features), dtype))
        self.packed: PackedWeight | None = nnx.data(None)
        self.qtype: str | None = None

    def set_packed(self, blocks: np.ndarray | jax.Array | None, qtype: str | None) -> None:
        """Attach (or with None, remove) the GGUF blocks of this layer's weight.

        Args:
          blocks: uint8 ``[Out, In / 32 * block_bytes(qtype)]``; they must encode ``kernel.T``.
          qtype: ``"Q4_1"`` or ``"Q8_0"``.

        Raises:
          ValueError: unknown ``qtype`` or a shape that does not match ``[Out, RB]``.
          TypeError: ``blocks`` is not uint8.
        """
        if blocks is None:
            self.packed, self.qtype = nnx.data(None), None
            return
        self.packed = nnx.data(make_packed(blocks, qtype, self.out_features, self.in_features))
        self.qtype = qtype

    def __call__(self, x: Float[Array, "*M In"]) -> Float[Array, "*M Out"]:
        packed = None if self.packed is None else self.packed[...]
        return packed_matmul(x, self.kernel[...], packed, self.qtype, transposed=True)
