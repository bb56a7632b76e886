"""SimHash codes on the host: the decode step's query codes in one C++ pass over the hyperplanes.

A decode step hashes each query head against the ``K*L`` hyperplanes of every sparse layer. The
hyperplanes are ``D*K*L`` floats per layer, a few MB at large L, and there are only ``B*Hq`` rows:
XLA's dot for that shape streams the matrix at a fraction of the machine's bandwidth and compute.
The kernel (``host_ops/simhash.cc``) reads each group of 64 hyperplanes once for every row and keeps
only the signs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, UInt32

from magicpig_jax import lsh
from magicpig_jax.host._ext import impl_code, ops
from magicpig_jax.host.validate import check_int

__all__ = ["host_simhash_codes"]


def host_simhash_codes(
    x: Float[Array, "... D"],
    projections: Float[Array, "D KL"],
    K: int,
    L: int,
    *,
    center: Float[Array, "... D"] | None = None,
    impl: str = "auto",
    max_threads: int = 0,
) -> UInt32[Array, "... L"]:
    """SimHash codes of (centered) vectors, one K-bit code per table, by the host kernel.

    The codes of :func:`magicpig_jax.lsh.simhash_codes` applied to ``x.astype(float32) - center``
    (the reference it is tested against): bit ``j`` of table ``l`` is 1 iff the product with
    ``projections[:, l*K + j]`` is > 0; a zero or NaN product gives 0. The kernel sums the products
    in another order than XLA's dot, so a product within float32 rounding of zero may take the
    other sign. The centered rows are formed in a small buffer per work item, never as an array
    the size of ``x``.

    Args:
      x: float32 or bfloat16 ``[..., D]`` (other float dtypes are cast to float32), e.g. the
        queries ``[B, Hq, D]`` or the keys ``[B, Hkv, N, D]``.
      projections: float32 ``[D, K*L]`` from :func:`magicpig_jax.lsh.simhash_projections`.
      K: bits per table, 1..32.
      L: tables, >= 2.
      center: None (no centering), or float ``[*x.shape[:j], D]`` for some ``j``: the vector
        subtracted from every row under that prefix, e.g. the keys' mean ``[B, Hkv, D]``.
      impl: ``"auto"`` (AVX2 if the CPU has it), ``"scalar"`` or ``"avx2"``.
      max_threads: cap on the kernel's worker threads, 0..4096 (0 = XLA's intra-op pool size).

    Returns:
      uint32 ``[..., L]``.

    Raises:
      TypeError / ValueError: a non-float ``x`` or ``projections``; bad ``K``, ``L``, ``impl``,
        ``max_threads``, or shapes of ``projections`` or ``center``.
      ImportError: the native extension is not built.

    Source: arXiv 2410.16179, Section 4.2 (SimHash, Charikar 2002; keys centered by their mean).
    """
    lsh.validate_k_l(K, L)
    code = impl_code(impl)
    max_threads = check_int("max_threads", max_threads, 0, 4096)
    if getattr(x, "ndim", 0) < 1 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., D] with D >= 1, got shape {tuple(getattr(x, 'shape', ()))}")
    if not hasattr(projections, "shape") or (center is not None and not hasattr(center, "shape")):
        raise TypeError("projections and center must be arrays (jax or NumPy), got "
                        f"{type(projections).__name__} and {type(center).__name__}")
    D = x.shape[-1]
    if projections.ndim != 2 or projections.shape != (D, K * L):
        raise ValueError(
            f"projections must be [D, K*L] = {[D, K * L]} for x of last dim {D}, got {list(projections.shape)}"
        )
    lead = x.shape[:-1]
    if center is None:
        center = jnp.zeros((1, D), jnp.float32)
    else:
        cs = tuple(center.shape)
        if len(cs) < 1 or cs[-1] != D or cs[:-1] != lead[: len(cs) - 1]:
            raise ValueError(f"center must be [*x.shape[:j], D] for x of shape {list(x.shape)}, got {list(cs)}")
        center = jnp.asarray(center, jnp.float32).reshape(-1, D)
    ops()
    xa = jnp.asarray(x)
    if not jnp.issubdtype(xa.dtype, jnp.floating):
        raise TypeError(f"x must be a floating dtype (float32, bfloat16, ...), got {xa.dtype}")
    if not jnp.issubdtype(jnp.asarray(projections).dtype, jnp.floating):  # as lsh.simhash_codes
        raise TypeError(f"projections must be a float array, got {jnp.asarray(projections).dtype}")
    if xa.dtype != jnp.bfloat16:
        xa = xa.astype(jnp.float32)
    rows = xa.reshape(-1, D)
    M = rows.shape[0]
    if M == 0:
        return jnp.zeros((*lead, L), jnp.uint32)
    codes = jax.ffi.ffi_call(
        "magicpig_simhash_codes", jax.ShapeDtypeStruct((M, L), jnp.uint32), vmap_method="sequential"
    )(rows, center, jnp.asarray(projections, jnp.float32), K=np.int64(K), L=np.int64(L), impl=np.int64(code),
      max_threads=np.int64(max_threads))
    return codes.reshape(*lead, L)
