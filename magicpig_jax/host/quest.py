"""Quest attention on the host KV cache (XLA FFI, CPU), with per-page key bounds kept beside the cache.

Quest (Tang et al., ICML 2024, arXiv 2406.10774, Section 3.2) cuts the cache into pages of
``page_size`` positions and keeps, per page and KV head, the elementwise min and max of its
keys; at each step it scores every page by the upper bound of ``q·k`` those give, keeps the
best pages and attends exactly over their keys. Here:

* :class:`QuestPages` holds the bounds of a range ``[start, end)`` of each row (float32
  ``[B, Hkv, P, D]`` twice), page j = ``[start + j*page_size, ...)``;
  :func:`quest_build_pages` computes them after prefill, :func:`quest_append_pages` extends the
  range when keys join it (the last partial page's bounds are widened, new pages filled), so
  the bounds are maintained with the cache instead of recomputed;
* :func:`host_quest_attention` runs the C++ handler ``magicpig_quest_attention``
  (``host_ops/quest_attention.cc``): page scores, a partial selection of the best pages
  (``std::nth_element``; ties by the smaller page), exact attention over their K and V rows.

It has the semantics of :func:`magicpig_jax.attention.quest_attention` on the range.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from magicpig_jax.attention._common import check_lengths, check_qkv, check_softcap, int32_clipped
from magicpig_jax.attention.baselines import Budget, check_budget, check_page_size
from magicpig_jax.attention.baselines import quest_pages_kept as baseline_pages_kept
from magicpig_jax.host._ext import impl_code, ops
from magicpig_jax.host.exact import MAX_GROUP
from magicpig_jax.host.validate import check_int, check_kv_dtypes

__all__ = ["QuestPages", "quest_build_pages", "quest_append_pages", "host_quest_attention", "quest_pages_kept",
           "quest_page_bytes"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class QuestPages:
    """Per-page key bounds of the range ``[start, end)`` of each row (a pytree).

    Attributes:
      kmin, kmax: float32 ``[B, Hkv, P, D]``, the elementwise min and max of the keys of each page
        (pages past the range hold +inf / -inf).
      start, end: int32 ``[B]``.
      page_size: static int.

    ``P`` is the number of pages, ``ceil(capacity / page_size)``.

    Source: Tang et al., ICML 2024 (arXiv 2406.10774), Section 3.2 (the per-page min/max metadata).
    """

    kmin: Float[Array, "B Hkv P D"]
    kmax: Float[Array, "B Hkv P D"]
    start: Int[Array, " B"]
    end: Int[Array, " B"]
    page_size: int = dataclasses.field(metadata=dict(static=True), default=16)


def _bounds_of(k, start, end, page_size: int, P: int):
    """``(kmin, kmax)`` ``[B, Hkv, P, D]`` of the keys ``[start, end)`` paged from ``start``."""
    B, Hkv, N, D = k.shape
    j = jnp.arange(P * page_size, dtype=jnp.int32)
    pos = start[:, None] + j[None, :]  # [B, P*ps]
    valid = pos < end[:, None]
    idx = jnp.clip(pos, 0, N - 1)
    kp = jnp.take_along_axis(k.astype(jnp.float32), idx[:, None, :, None], axis=2)  # [B, Hkv, P*ps, D]
    m = jnp.broadcast_to(valid[:, None, :, None], kp.shape).reshape(B, Hkv, P, page_size, D)
    return _masked_min_max(kp.reshape(B, Hkv, P, page_size, D), m, axis=3)


def _masked_min_max(x, m, axis: int):
    """``(min, max)`` of ``x`` where ``m`` along ``axis``; NaN where a masked-in element is NaN.

    XLA's CPU min/max reductions skip NaN: a page holding a NaN key would get finite bounds and
    the host op could leave that key out without a trace (its NaN page bound makes the head NaN).
    """
    nan = jnp.any(m & jnp.isnan(x), axis=axis)
    lo = jnp.where(nan, jnp.nan, jnp.min(jnp.where(m, x, jnp.inf), axis=axis))
    hi = jnp.where(nan, jnp.nan, jnp.max(jnp.where(m, x, -jnp.inf), axis=axis))
    return lo, hi


def _nan_propagating(fn):
    return lambda a, b: jnp.where(jnp.isnan(a) | jnp.isnan(b), jnp.nan, fn(a, b))


def quest_build_pages(k: Float[Array, "B Hkv N D"], start: Int[Array, " B"], end: Int[Array, " B"],
                      page_size: int = 16, capacity: int | None = None) -> QuestPages:
    """The page bounds of the keys ``[start, end)`` of each row (pure JAX; jit-able).

    Args:
      k: float ``[B, Hkv, N, D]``.
      start, end: int ``[B]`` (clipped to ``[0, N]``, ``end >= start``).
      page_size: static ``int >= 1``.
      capacity: static int; the positions the range may grow to (default N):
        ``P = ceil(capacity / page_size)``, pages counted from ``start``; at least every row's
        ``end - start`` (checked where those are concrete).

    Returns:
      a :class:`QuestPages`.

    Raises:
      ValueError / TypeError: a bad ``page_size``, ``capacity`` or shapes.

    Source: Tang et al., ICML 2024 (arXiv 2406.10774), Section 3.2 (each page's elementwise key min/max).
    """
    check_page_size(page_size)
    if not hasattr(k, "ndim"):
        raise TypeError(f"k must be an array [B, Hkv, N, D], got {type(k).__name__}")
    if k.ndim != 4:
        raise ValueError(f"k must be [B, Hkv, N, D], got shape {tuple(k.shape)}")
    B, _, N, _ = k.shape
    if capacity is None:
        capacity = N
    if getattr(capacity, "ndim", None) == 0 and np.issubdtype(getattr(capacity, "dtype", object), np.integer):
        capacity = int(capacity)  # a concrete 0-d NumPy or JAX integer
    if isinstance(capacity, bool | np.bool_) or not isinstance(capacity, int | np.integer):
        raise TypeError(f"capacity must be an int, got {capacity!r}")
    capacity = int(capacity)
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    start = check_lengths(start, B, N, "start")
    end = jnp.maximum(check_lengths(end, B, N, "end"), start)
    if not isinstance(end, jax.core.Tracer) and not isinstance(start, jax.core.Tracer) and B:
        longest = int(jnp.max(end - start))
        if capacity < longest:  # the pages past capacity were dropped: their keys had no bound
            raise ValueError(f"capacity ({capacity}) must hold every row's range [start, end); the longest has "
                             f"{longest} keys")
    P = -(-capacity // page_size)
    kmin, kmax = _bounds_of(k, start, end, page_size, P)
    return QuestPages(kmin=kmin, kmax=kmax, start=start, end=end, page_size=page_size)


def quest_append_pages(pages: QuestPages, k: Float[Array, "B Hkv N D"], counts: Int[Array, " B"],
                       max_count: int) -> QuestPages:
    """Extend each row's range by ``counts[b]`` keys (``[end, end + counts)``), updating the bounds in place.

    Only the pages the new keys fall in are touched: the bounds of the last partial page are
    widened (min/max are monotone), later pages filled.

    Args:
      pages: the current :class:`QuestPages`.
      k: the cache ``[B, Hkv, N, D]`` holding the new keys.
      counts: int ``[B]``, ``0 <= counts[b] <= max_count`` (concrete values outside are refused;
        traced ones are clipped into it).
      max_count: static bound on ``counts`` (e.g. the generation buffer), an int >= 1.

    Returns:
      the updated :class:`QuestPages` (``end`` advanced by ``counts``).

    Raises:
      TypeError: ``counts`` not an integer array.
      ValueError: a ``k`` whose B, Hkv or D differ from the pages'; a ``max_count`` below 1;
        concrete ``counts`` outside ``[0, max_count]``, or ``end + counts`` past the cache's N
        positions or the ``P * page_size`` positions the pages were built for
        (``start + P * page_size``), naming the row; under ``jit`` the caller keeps within the
        capacity (the decoder checks its cache's before each step).
    """
    if k.ndim != 4:
        raise ValueError(f"k must be [B, Hkv, N, D], got shape {tuple(k.shape)}")
    B, Hkv, N, D = k.shape
    ps = pages.page_size
    P = pages.kmin.shape[2]
    built = (pages.kmin.shape[0], pages.kmin.shape[1], pages.kmin.shape[3])
    if (B, Hkv, D) != built:  # another cache's keys would widen these heads' bounds with theirs
        raise ValueError(f"k [B, Hkv, N, D] = {[B, Hkv, N, D]} does not fit the pages, built for B, Hkv, D = "
                         f"{list(built)}")
    if isinstance(max_count, bool) or not isinstance(max_count, int) or max_count < 1:
        raise ValueError(f"max_count must be an int >= 1, got {max_count!r}")
    dtype = counts.dtype if hasattr(counts, "dtype") else np.asarray(counts).dtype
    if not jnp.issubdtype(dtype, jnp.integer):  # a float 2.5 would be cut to 2
        raise TypeError(f"counts must be an integer array, got {dtype}")
    if not isinstance(counts, jax.core.Tracer):  # concrete counts are checked whether or not the pages are traced
        want = np.asarray(counts)
        if want.shape != (B,) or ((want < 0) | (want > max_count)).any():
            raise ValueError(f"counts must be int [B] = [{B}] in [0, max_count = {max_count}], got {want.tolist()}")
    if not any(isinstance(x, jax.core.Tracer) for x in (pages.start, pages.end, counts)):
        past = np.nonzero(np.asarray(pages.end) + want > N)[0]
        if past.size:
            b = int(past[0])
            raise ValueError(f"row {b}: appending {int(want[b])} keys at position {int(np.asarray(pages.end)[b])} "
                             f"goes past the cache's {N} positions")
        room = np.asarray(pages.start) + P * ps - np.asarray(pages.end)
        for b in np.nonzero(want > room)[0]:
            raise ValueError(f"row {int(b)}: appending {int(want[b])} keys at position {int(np.asarray(pages.end)[b])} "
                             f"exceeds the {P} pages of {ps} positions built from position "
                             f"{int(np.asarray(pages.start)[b])}")
    counts = int32_clipped(counts, 0, max_count, "counts")  # in their own width: 2**32 + 1 cast first wrapped to 1
    new_end = jnp.minimum(pages.end + counts, N)
    first = (pages.end - pages.start) // ps  # the page the first new key falls in
    W = -(-max_count // ps) + 1  # pages a block of max_count keys can touch
    pidx = jnp.clip(first[:, None] + jnp.arange(W, dtype=jnp.int32)[None, :], 0, P - 1)  # [B, W]
    j = pidx[:, :, None] * ps + jnp.arange(ps, dtype=jnp.int32)[None, None, :]  # [B, W, ps] offsets in range
    pos = pages.start[:, None, None] + j
    new = (pos >= pages.end[:, None, None]) & (pos < new_end[:, None, None])
    idx = jnp.clip(pos, 0, N - 1).reshape(B, -1)
    kp = jnp.take_along_axis(k.astype(jnp.float32), idx[:, None, :, None], axis=2).reshape(B, Hkv, W, ps, D)
    m = jnp.broadcast_to(new[:, None, :, :, None], kp.shape)
    add_min, add_max = _masked_min_max(kp, m, axis=3)  # [B, Hkv, W, D]
    bi = jnp.arange(B)[:, None]

    def upd(arr, vals, fn):
        cur = arr[bi, :, pidx]  # [B, W, Hkv, D]
        return arr.at[bi, :, pidx].set(fn(cur, vals.transpose(0, 2, 1, 3)))

    kmin = upd(pages.kmin, add_min, _nan_propagating(jnp.minimum))
    kmax = upd(pages.kmax, add_max, _nan_propagating(jnp.maximum))
    return QuestPages(kmin=kmin, kmax=kmax, start=pages.start, end=new_end, page_size=ps)


def quest_pages_kept(budget: Budget, n: jax.Array, page_size: int) -> jax.Array:
    """Pages each row keeps, as :func:`magicpig_jax.attention.quest_attention`: ``max(1, floor(t/page))``
    with ``t = min(budget_tokens, n)``, or every page when ``t = n`` (int32 ``[B]``).

    Raises:
      TypeError, ValueError: as :func:`magicpig_jax.attention.budget_tokens` (a budget that is not a
        token count >= 0 or a fraction in (0, 1]).
    """
    return baseline_pages_kept(budget, n, page_size)


def quest_page_bytes(pages: QuestPages) -> int:
    """Bytes of the page bounds (the metadata Quest keeps beside the cache)."""
    return int(pages.kmin.nbytes + pages.kmax.nbytes)


def host_quest_attention(
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    pages: QuestPages,
    budget: Budget,
    *,
    context: Int[Array, " B"] | None = None,
    impl: str = "auto",
    max_threads: int = 0,
    softcap: float | None = None,
) -> tuple[Float[Array, "B Hq D"], Float[Array, "B Hq"]]:
    """Quest attention over the range ``[pages.start, pages.end)`` of each row, in the host op.

    Equal to :func:`magicpig_jax.attention.quest_attention` ``(q, k[:, :, s:], v[:, :, s:],
    page_size, budget, end - s)`` for a row starting at ``s`` (same pages kept, same output to
    float32 rounding): each query head keeps its ``max(1, floor(t / page_size))`` best pages
    (``t = min(budget_tokens, n)``), or all of them when ``t = n``. With ``context``, the keys
    ``[0, start)`` and ``[end, context)`` (a decoder's sinks and unhashed tail) are attended exactly
    too, in the same softmax (the merge with the static set, in one pass).

    Args:
      q: float ``[B, Hq, D]``.
      k, v: ``[B, Hkv, N, D]``, both float32 or both bfloat16 (read in place).
      pages: the :class:`QuestPages` of these keys.
      budget: ``int >= 1`` tokens or a ``float`` in ``(0, 1]`` fraction of each row's range.
      context: optional int ``[B]``, each row's valid keys (clipped to ``[end, N]``).
      impl: ``"auto"``, ``"scalar"`` or ``"avx2"``; max_threads: cap on the op's threads (0: the pool).
      softcap: None, or c in [0.001, 1e6]: each logit s of the softmax becomes ``c * tanh(s / c)``
        (Gemma 2's ``attn_logit_softcapping``); the pages are ranked by the uncapped bounds, which the
        monotone cap orders the same way.

    Returns:
      ``(out, lse)``: out float32 ``[B, Hq, D]``, lse float32 ``[B, Hq]``; an empty range gives ``0, -inf``.

    Raises:
      ValueError: mismatched shapes, ``G > MAX_GROUP``, a budget out of range, bad ``impl``/``max_threads``,
        a softcap out of range.
      TypeError: k and v not both float32 or both bfloat16, ``pages`` not a :class:`QuestPages`.
      ImportError: the native extension is not built.

    Source: Tang et al., ICML 2024 (arXiv 2406.10774), Section 3.2 / Algorithm 1.
    """
    code = impl_code(impl)
    max_threads = check_int("max_threads", max_threads, 0, 4096)
    B, Hq, Hkv, N, D = check_qkv(q, k, v)
    check_kv_dtypes(k, v)
    check_budget(budget)
    softcap = check_softcap(softcap)
    if not isinstance(pages, QuestPages):
        raise TypeError(f"pages must be a QuestPages, got {type(pages).__name__}")
    if pages.kmin.shape[:2] != (B, Hkv) or pages.kmin.shape[3] != D or pages.kmax.shape != pages.kmin.shape:
        raise ValueError(f"pages.kmin/kmax must be [B, Hkv, P, D] = [{B}, {Hkv}, P, {D}], got "
                         f"{tuple(pages.kmin.shape)} and {tuple(pages.kmax.shape)}")
    if Hq // Hkv > MAX_GROUP:
        raise ValueError(f"G = Hq / Hkv must be <= {MAX_GROUP}, got {Hq // Hkv}")
    n = pages.end - pages.start
    kept = quest_pages_kept(budget, n, pages.page_size)
    ctx = jnp.zeros_like(pages.end) if context is None else check_lengths(context, B, N, "context")
    ops()
    return jax.ffi.ffi_call(
        "magicpig_quest_attention",
        (jax.ShapeDtypeStruct((B, Hq, D), jnp.float32), jax.ShapeDtypeStruct((B, Hq), jnp.float32)),
        vmap_method="sequential",
    )(q.astype(jnp.float32), k, v, pages.kmin.astype(jnp.float32), pages.kmax.astype(jnp.float32),
      pages.start.astype(jnp.int32), pages.end.astype(jnp.int32), kept, ctx.astype(jnp.int32),
      page_size=np.int64(pages.page_size), with_static=np.int64(context is not None), impl=np.int64(code),
      max_threads=np.int64(max_threads), softcap=np.float32(softcap or 0.0))
