"""Baseline estimators of decode attention: exact TopK, Quest, and oracle sampling.

All three follow :func:`magicpig_jax.attention.dense_attention`'s conventions:
q ``[B, Hq, D]``, k/v ``[B, Hkv, N, D]``, optional int ``lengths [B]``, query
head h reads KV head ``h // (Hq // Hkv)``, computed in float32 whatever the
input dtype, natural-log LSE, and an empty selection gives ``out = 0``,
``lse = -inf`` (a NaN logit of a kept key gives NaN). Keys a query head does not keep (or never draws) are selected
out of its logits and values: NaN in their rows leaves its output unchanged.

Budgets. ``budget`` is a static Python value (pass it through
``jax.jit(..., static_argnames=("budget",))``); ``lengths`` stays dynamic:

* an ``int >= 1`` is a token count (for TopK/Quest capped at the row's length);
* a ``float`` in ``(0, 1]`` is a fraction of each row's context: row b gets
  ``ceil(f * lengths[b])`` tokens. ``f`` is first replaced by the nearest
  rational ``num/den`` with ``den <= 32768`` (exact for 0.02, 0.1, 1/3, ...) and
  the ceiling is evaluated in exact int32 arithmetic, so there is no float
  rounding at the boundary (``0.1 * 30`` gives 3 tokens, not 4). A fraction that no
  such rational comes within 0.1% of (below about 1/32768, e.g. ``1e-5``) is refused:
  it would grant up to 3x the keys asked for; give a token count instead.

Sources: arXiv 2410.16179 (MagicPIG), Section 3 (TopK is biased, Fig. 2;
oracle sampling, Definition 3.1, Theorems 3.2-3.3) and Tang et al., "Quest:
Query-Aware Sparsity for Efficient Long-Context LLM Inference", ICML 2024,
arXiv 2406.10774, Section 3.
"""

from __future__ import annotations

import fractions
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, Key, UInt32

from magicpig_jax.attention._common import (
    check_lengths,
    check_qkv,
    check_softcap,
    grouped_logits,
    int32_clipped,
    masked_softmax_attention,
    selected_weighted_sum,
    valid_mask,
)
from magicpig_jax.lsh import check_prng_key

__all__ = [
    "topk_attention",
    "quest_attention",
    "oracle_sampling_attention",
    "Budget",
    "budget_tokens",
    "topk_mask",
    "quest_mask",
    "quest_pages_kept",
    "quest_rows_read",
    "quest_page_scores",
]

# Largest denominator of the rational that replaces a fractional budget; keeps
# num * (length % den) < 2**30, so the exact ceiling fits in int32.
_MAX_DEN = 1 << 15
# How far (relative) that rational may be from the float budget it stands for.
_MAX_FRACTION_ERROR = 1e-3

# A budget: an int (tokens) or a float in (0, 1] (fraction of the context); NumPy scalars count as either.
Budget = int | float | np.integer | np.floating


MAX_BUDGET_TOKENS = 2**31 - 1  # token budgets are int32 on the device
MAX_PAGE_SIZE = 65536  # Quest's page, in tokens (check_page_size)


def check_budget(budget: object) -> fractions.Fraction | int:
    """Validate ``budget``; return it as an int (tokens) or a Fraction in (0, 1].

    NumPy integer and floating scalars count as int and float.
    """
    if isinstance(budget, np.integer):
        budget = int(budget)
    elif isinstance(budget, np.floating):
        budget = float(budget)
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise TypeError(
            f"budget must be an int (tokens) or a float in (0, 1] (fraction of the context), "
            f"got {type(budget).__name__} {budget!r}"
        )
    if isinstance(budget, int):
        if budget < 1:
            raise ValueError(f"budget as a token count must be >= 1, got budget={budget}")
        if budget > MAX_BUDGET_TOKENS:  # int32 on the device: a larger count would wrap to another budget
            raise ValueError(f"budget as a token count must be <= {MAX_BUDGET_TOKENS} (2**31 - 1; a budget above a "
                             f"row's length keeps every key), got budget={budget}")
        return budget
    if not (math.isfinite(budget) and 0.0 < budget <= 1.0):
        raise ValueError(f"budget as a fraction of the context must be in (0, 1], got budget={budget}")
    frac = fractions.Fraction(budget).limit_denominator(_MAX_DEN)
    off = abs(frac - fractions.Fraction(budget)) / fractions.Fraction(budget)
    if off > _MAX_FRACTION_ERROR:
        raise ValueError(f"budget as a fraction must be within 0.1% of a ratio num/den with den <= {_MAX_DEN} "
                         f"(its exact int32 form), got budget={budget}, {float(off):.1%} from the nearest ({frac}): "
                         f"give a token count instead")
    return frac


def budget_tokens(budget: Budget, lengths: Int[Array, " B"]) -> Int[Array, " B"]:
    """Tokens granted to each row by a budget (see the module docstring).

    Args:
      budget: ``int >= 1`` (that many tokens for every row) or ``float`` in
        ``(0, 1]`` (``ceil(f * lengths[b])`` tokens for row b, 0 for an empty row, where f
        is first replaced by the nearest fraction with a denominator <= 32768 so that the
        product is exact in int32: a float that differs from such a fraction by less than
        that rounding, such as ``0.5 + 2**-20``, counts as the fraction; one more than 0.1%
        from every such fraction is refused).
      lengths: int ``[B]`` valid keys per row (a negative one counts as 0, one past
        2**31 - 1 as 2**31 - 1).

    Returns:
      int32 ``[B]``. Not capped at ``lengths``: an int budget larger than a row
      is returned as is (TopK/Quest cap it, oracle sampling draws that many).

    Raises:
      TypeError: ``budget`` is neither int nor float (bool is rejected); ``lengths`` not integers.
      ValueError: an int budget < 1 or a float outside ``(0, 1]`` or too small to be exact
        (the module docstring).

    Source: the equal-budget comparison of arXiv 2410.16179, Section 5 (TopK and the
    baselines given the keys MagicPIG samples).
    """
    b = check_budget(budget)
    if not isinstance(lengths, jax.Array):  # host values: clipped below in their own width
        lengths = np.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise TypeError(f"lengths must be an integer array, got {lengths.dtype}")
    # a negative row holds no key, as in the estimators; clipped in the array's own width (a
    # uint32 or host int64 past int32 must not wrap to a small or negative count)
    top = np.iinfo(np.int32).max
    xp = np if isinstance(lengths, np.ndarray) else jnp
    lengths = xp.maximum(lengths, 0)
    if np.iinfo(lengths.dtype).max > top:  # (a narrower type would wrap the bound itself)
        lengths = xp.minimum(lengths, top)
    lengths = jnp.asarray(lengths.astype(np.int32))
    if isinstance(b, int):
        return jnp.full(lengths.shape, b, dtype=jnp.int32)
    num, den = jnp.int32(b.numerator), jnp.int32(b.denominator)
    # ceil(num * len / den) without overflow: len = a * den + r, r < den <= 2**15.
    a, r = lengths // den, lengths % den
    return num * a + (num * r + den - 1) // den


def _max_budget_tokens(budget: Budget, N: int) -> int:
    """Static upper bound of :func:`budget_tokens` over rows of length <= N."""
    b = check_budget(budget)
    if isinstance(b, int):
        return b
    return -((-b.numerator * N) // b.denominator)  # exact ceil


def _rank_desc(scores: jax.Array) -> jax.Array:
    """Rank of each entry along the last axis in descending order (0 = largest; ties by index)."""
    order = jnp.argsort(scores, axis=-1, descending=True, stable=True)
    ranks = jnp.broadcast_to(jnp.arange(scores.shape[-1], dtype=jnp.int32), scores.shape)
    return jnp.put_along_axis(
        jnp.zeros(scores.shape, jnp.int32), order, ranks, axis=-1, inplace=False
    )


def topk_mask(
    q: Float[Array, "B Hq D"], k: Float[Array, "B Hkv N D"], budget: Budget, lengths: Int[Array, " B"]
) -> Bool[Array, "B Hkv G N"]:
    """The keys exact TopK keeps, per query head (see :func:`topk_attention`).

    Args:
      q: float ``[B, Hq, D]``; k: float ``[B, Hkv, N, D]`` (shapes validated by the caller).
      budget: static int or fraction (see :func:`budget_tokens`).
      lengths: int32 ``[B]`` valid keys per row, already clipped to ``[0, N]``.

    Returns:
      bool ``[B, Hkv, G, N]`` (``G = Hq / Hkv``): the ``min(budget_tokens, lengths[b])``
      valid keys with the largest logits, ties broken by position.

    Raises:
      TypeError / ValueError: an invalid budget.

    Source: arXiv 2410.16179, Section 3.1 (the TopK baseline).
    """
    N = k.shape[2]
    logits = grouped_logits(q, k)
    valid = valid_mask(lengths, N)
    keep = jnp.minimum(budget_tokens(budget, lengths), lengths)
    ranks = _rank_desc(jnp.where(valid, logits, -jnp.inf))
    return valid & (ranks < keep[:, None, None, None])


def topk_attention(
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    budget: Budget,
    lengths: Int[Array, " B"] | None = None,
    *,
    softcap: float | None = None,
) -> tuple[Float[Array, "B Hq D"], Float[Array, "B Hq"]]:
    """Exact TopK attention: softmax over the ``budget`` highest-scoring keys of each query head.

    For each query head, the valid keys are ranked by ``q·k/sqrt(D)`` (equal scores
    broken by position; equal keys can score a float32 rounding apart in XLA's product, and the
    host op's may round otherwise, so which of several equal keys is kept can differ between
    the two) and the first ``min(budget_tokens, lengths[b])`` are kept;
    the output is the exact softmax attention over the kept keys. This is the
    biased baseline of arXiv 2410.16179, Section 3.1 / Fig. 2 (TopK ignores the
    tail of a long-tailed attention distribution).

    Args:
      q: float ``[B, Hq, D]``.
      k, v: float ``[B, Hkv, N, D]``.
      budget: static; ``int >= 1`` tokens, or ``float`` in ``(0, 1]`` fraction of
        each row's length (see :func:`budget_tokens`).
      lengths: int ``[B]`` valid keys per row (default N; clipped to [0, N]).
      softcap: None, or c in [0.001, 1e6]: each logit s of the softmax becomes ``c * tanh(s / c)``
        (Gemma 2's ``attn_logit_softcapping``). The keys are ranked by the uncapped logits,
        which the monotone cap orders the same way (capping first could only add ties where
        float32 ``tanh`` saturates).

    Returns:
      ``(out, lse)``: out float32 ``[B, Hq, D]``; lse float32 ``[B, Hq]``, the
      natural-log LSE of the *kept* logits (so ``lse <= dense lse``, with
      equality iff every valid key is kept). An empty row gives ``0, -inf``.

    Raises:
      ValueError: mismatched shapes, Hq not a multiple of Hkv, a budget or softcap out of range.
      TypeError: non-float q/k/v, non-integer lengths, or a budget of the wrong type.
    """
    B, _, _, N, _ = check_qkv(q, k, v)
    check_budget(budget)
    softcap = check_softcap(softcap)
    lengths = check_lengths(lengths, B, N)
    keep = topk_mask(q, k, budget, lengths)
    return masked_softmax_attention(grouped_logits(q, k, softcap), keep, v)


def check_page_size(page_size: object) -> int:
    """Validate Quest's ``page_size``: an int in ``[1, MAX_PAGE_SIZE]``.

    The pages are padded to whole pages of positions, so a page far longer than any context would
    allocate that much (Quest's pages are tens of tokens; Tang et al. 2024 use 16).

    Raises:
      TypeError: not an int.
      ValueError: outside ``[1, MAX_PAGE_SIZE]``.
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int):
        raise TypeError(f"page_size must be an int, got {type(page_size).__name__} {page_size!r}")
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size must be in [1, {MAX_PAGE_SIZE}], got page_size={page_size}")
    return page_size


def quest_page_scores(
    q: Float[Array, "B Hq D"], k: Float[Array, "B Hkv N D"], page_size: int, lengths: Int[Array, " B"]
) -> Float[Array, "B Hkv G P"]:
    """Quest's per-page upper bound of ``q·k/sqrt(D)``.

    Page j holds positions ``[j*page_size, (j+1)*page_size)``; only valid keys
    enter its elementwise min/max. The bound is ``sum_d max(q_d min_d, q_d max_d)``, so it
    is >= every valid logit of the page; with finite bounds it is computed as the equal
    ``q⁺·max + q⁻·min`` (``q⁺ = max(q, 0)``, ``q⁻ = min(q, 0)``, two matrix products). A key
    with an infinite component would make that ``0 · inf = NaN`` where ``q_d`` has the other
    sign (the key's logit is then ``-inf``), so then it is summed per dimension. A NaN ``q`` or
    key, or ``q_d = 0`` against an infinite component, gives the page NaN.

    Args:
      q: float ``[B, Hq, D]``; k: float ``[B, Hkv, N, D]`` (shapes validated by the caller).
      page_size: static int >= 1.
      lengths: int32 ``[B]`` valid keys per row, already clipped to ``[0, N]``.

    Returns:
      float32 ``[B, Hkv, G, P]``, ``P = ceil(N / page_size)``; pages without a
      valid key score ``-inf``.

    Raises:
      ValueError / TypeError: an invalid ``page_size``.

    Source: Quest (Tang et al., ICML 2024, arXiv 2406.10774), Section 3.2, Algorithm 1.
    """
    check_page_size(page_size)
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    P = -(-N // page_size)
    pad = P * page_size - N
    valid = jnp.arange(P * page_size, dtype=jnp.int32)[None, :] < lengths[:, None]  # [B, P*ps]
    valid = valid.reshape(B, 1, P, page_size, 1)
    kp = jnp.pad(k.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
    kp = kp.reshape(B, Hkv, P, page_size, D)
    page_valid = jnp.any(valid, axis=3)  # [B, 1, P, 1]
    kmin = jnp.where(page_valid, jnp.min(jnp.where(valid, kp, jnp.inf), axis=3), 0.0)
    kmax = jnp.where(page_valid, jnp.max(jnp.where(valid, kp, -jnp.inf), axis=3), 0.0)
    qg = q.astype(jnp.float32).reshape(B, Hkv, G, D)

    def two_products(_):  # equal to the sum below where every bound is finite, and one matmul each
        hi = jax.lax.Precision.HIGHEST
        return jnp.einsum("bhgd,bhpd->bhgp", jnp.maximum(qg, 0.0), kmax, precision=hi) + jnp.einsum(
            "bhgd,bhpd->bhgp", jnp.minimum(qg, 0.0), kmin, precision=hi)

    def per_dimension(_):  # fused into the sum (no [.., P, D] buffer)
        qd = qg[:, :, :, None, :]
        return jnp.sum(jnp.maximum(qd * kmin[:, :, None], qd * kmax[:, :, None]), axis=-1)

    # A key with an infinite component (logit -inf where q_d has the other sign) would give its
    # page 0 * inf = NaN in the products: such bounds take the per-dimension form.
    finite = jnp.all(jnp.isfinite(kmin)) & jnp.all(jnp.isfinite(kmax))
    score = jax.lax.cond(finite, two_products, per_dimension, None)
    score = score / jnp.float32(math.sqrt(D))
    return jnp.where(page_valid[:, :, None, :, 0], score, -jnp.inf)


def quest_mask(
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hkv N D"],
    page_size: int,
    budget: Budget,
    lengths: Int[Array, " B"],
) -> Bool[Array, "B Hkv G N"]:
    """The keys Quest keeps, per query head (see :func:`quest_attention` for the page rule).

    Args:
      q: float ``[B, Hq, D]``; k: float ``[B, Hkv, N, D]`` with N >= 1 (validated by the caller).
      page_size: static int >= 1.
      budget: static int or fraction (see :func:`budget_tokens`).
      lengths: int32 ``[B]`` valid keys per row, already clipped to ``[0, N]``.

    Returns:
      bool ``[B, Hkv, G, N]``: the valid keys of the selected pages.

    Raises:
      TypeError / ValueError: an invalid ``page_size`` or ``budget``.

    Source: Quest (arXiv 2406.10774), Section 3.2.
    """
    B = q.shape[0]
    N = k.shape[2]
    scores = quest_page_scores(q, k, page_size, lengths)
    P = scores.shape[-1]
    pages = quest_pages_kept(budget, lengths, page_size)
    keep_page = _rank_desc(scores) < pages[:, None, None, None]  # [B, Hkv, G, P]
    keep = jnp.repeat(keep_page, page_size, axis=-1, total_repeat_length=P * page_size)[..., :N]
    return keep & valid_mask(lengths, N).reshape(B, 1, 1, N)


def quest_pages_kept(budget: Budget, lengths: Int[Array, " B"], page_size: int) -> Int[Array, " B"]:
    """Pages each Quest query head keeps per row: ``max(1, floor(t / page_size))`` with
    ``t = min(budget_tokens, lengths[b])``, or every page when ``t = lengths[b]`` (int32 ``[B]``).

    Raises:
      TypeError: ``lengths`` not an integer array.
      TypeError, ValueError: as :func:`budget_tokens`.

    Source: Quest (arXiv 2406.10774), Section 3.2.
    """
    lengths = int32_clipped(lengths)  # an int8 120 + 15 wrapped to -8 pages, a uint32 3e9 to a negative count
    tokens = jnp.minimum(budget_tokens(budget, lengths), lengths)
    all_pages = -(-lengths // page_size)  # ceil division (lengths + page_size - 1 overflowed near 2**31)
    return jnp.where(tokens >= lengths, all_pages, jnp.maximum(tokens // page_size, 1)).astype(jnp.int32)


def quest_rows_read(budget: Budget, lengths: Int[Array, " B"], page_size: int) -> Int[Array, " B"]:
    """Keys a Quest query head attends in each row's range: the rows of its kept pages,
    ``min(pages * page_size, lengths[b])`` with ``pages = max(1, floor(t / page_size))``,
    ``t = min(budget_tokens, lengths[b])``, or every page when ``t = lengths[b]`` (int32 ``[B]``).

    A kept partial last page counts whole (it holds up to ``page_size - 1`` keys fewer), since which
    pages a head keeps is not known here; the budget itself undercounts by up to a page (a budget of
    4 keeps a whole page of 16).

    Raises:
      TypeError: ``lengths`` not an integer array.
      TypeError, ValueError: as :func:`budget_tokens`.

    Source: Quest (arXiv 2406.10774), Section 3.2.
    """
    lengths = int32_clipped(lengths)
    pages = quest_pages_kept(budget, lengths, page_size)
    # every page kept: the row's own keys (pages * page_size may pass int32 there)
    every = pages >= -(-lengths // page_size)
    return jnp.where(every, lengths, jnp.minimum(pages * page_size, lengths)).astype(jnp.int32)


def quest_attention(
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    page_size: int,
    budget: Budget,
    lengths: Int[Array, " B"] | None = None,
    *,
    softcap: float | None = None,
) -> tuple[Float[Array, "B Hq D"], Float[Array, "B Hq"]]:
    """Quest attention: exact softmax over the keys of the pages with the highest score upper bound.

    The cache is cut into pages of ``page_size`` consecutive positions. Per page
    and KV head, the elementwise minimum and maximum of its valid keys bound
    ``q·k`` from above by ``sum_d max(q_d min_d, q_d max_d)``
    (:func:`quest_page_scores`). Each query head keeps its
    ``max(1, floor(t_b / page_size))`` best pages, ``t_b = min(budget_tokens, lengths[b])``
    (so at least one page of a non-empty row), or every page when
    ``t_b = lengths[b]`` (then the result is dense attention); equal bounds are broken
    by page index (equal pages can bound a rounding apart, as TopK's equal keys), and it
    attends exactly over the valid keys of those pages.

    Args:
      q: float ``[B, Hq, D]``.
      k, v: float ``[B, Hkv, N, D]``.
      page_size: static ``int >= 1`` (Quest uses 16).
      budget: static; ``int >= 1`` tokens, or ``float`` in ``(0, 1]`` fraction of
        each row's length (see :func:`budget_tokens`).
      lengths: int ``[B]`` valid keys per row (default N; clipped to [0, N]).
      softcap: None, or c in [0.001, 1e6]: each logit s of the softmax becomes ``c * tanh(s / c)``
        (Gemma 2's ``attn_logit_softcapping``). The pages are ranked by the uncapped bounds,
        which the monotone cap orders the same way (capping first could only add ties where
        float32 ``tanh`` saturates).

    Returns:
      ``(out, lse)``: out float32 ``[B, Hq, D]``; lse float32 ``[B, Hq]``, the
      natural-log LSE over the logits of the kept keys. An empty row gives ``0, -inf``.

    Raises:
      ValueError: mismatched shapes, Hq not a multiple of Hkv, page_size, budget or softcap out of range.
      TypeError: non-float q/k/v, non-integer lengths, page_size or budget of the wrong type.

    Source: Tang et al., ICML 2024 (arXiv 2406.10774), Section 3.2 / Algorithm 1;
    compared against MagicPIG in arXiv 2410.16179, Section 5.
    """
    B, _, _, N, _ = check_qkv(q, k, v)
    check_page_size(page_size)
    check_budget(budget)
    softcap = check_softcap(softcap)
    lengths = check_lengths(lengths, B, N)
    if N == 0:
        return masked_softmax_attention(grouped_logits(q, k, softcap), valid_mask(lengths, N), v)
    keep = quest_mask(q, k, page_size, budget, lengths)
    return masked_softmax_attention(grouped_logits(q, k, softcap), keep, v)


def _inverse_cdf_draws(rng, w: jax.Array, S: int) -> jax.Array:
    """int32 ``[B, Hkv, G, S]``: S i.i.d. indices per head drawn from the weights ``w`` ``[B, Hkv, G, N]``.

    One uniform per draw, with shape ``[B, Hq, S]`` (so a head's draws do not depend on the
    grouping of heads), located in the float32 cumulative sum of ``w``.
    """
    B, Hkv, G, N = w.shape
    cdf = jnp.cumsum(w, axis=-1)
    u = jax.random.uniform(rng, (B, Hkv * G, S), dtype=jnp.float32).reshape(B, Hkv, G, S)
    x = u * cdf[..., -1:]
    idx = jax.vmap(lambda c, t: jnp.searchsorted(c, t, side="right"))(cdf.reshape(-1, N), x.reshape(-1, S))
    # x < total, so idx lands on a key of positive weight; only a rounding of
    # x up to the total can give N: map that to the last key of positive weight.
    positive = w.reshape(-1, N) > 0
    last = N - 1 - jnp.argmax(positive[:, ::-1], axis=-1).astype(jnp.int32)
    return jnp.minimum(idx.astype(jnp.int32), last[:, None]).reshape(B, Hkv, G, S)


def oracle_sampling_attention(
    rng: Key[Array, ""] | UInt32[Array, "2"],
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    budget: Budget,
    lengths: Int[Array, " B"] | None = None,
    *,
    softcap: float | None = None,
) -> tuple[Float[Array, "B Hq D"], Float[Array, "B Hq"], Int[Array, "B Hq"]]:
    """Oracle sampling (Definition 3.1): the mean value of ``n`` i.i.d. draws from the exact attention.

    Each query head draws ``n_b`` indices i.i.d. from ``w = softmax(q K^T/sqrt(D))``
    over its valid keys and outputs ``(1/n_b) sum_s v_{i_s}``; ``n_b`` is the
    budget (an int budget: that many draws, also when it exceeds the row's
    length, since draws are with replacement; a fraction f:
    ``ceil(f * lengths[b])`` draws). Unbiased, with covariance
    ``(sum_i w_i v_i v_i^T - o o^T) / n_b`` (Theorem 3.2); the expected number of
    distinct keys is ``sum_i 1 - (1 - w_i)^n_b <= 1 + n_b (1 - max_i w_i)``
    (Theorem 3.3).

    Sampling is by inverse CDF: one uniform per draw, drawn with shape
    ``[B, Hq, n_max]`` from ``rng`` (so a head's draws do not depend on the
    grouping of heads, and row b's draws do not depend on other rows' data),
    located in the float32 cumulative sum of ``w``.

    Args:
      rng: a ``jax.random`` key (typed or raw ``uint32[2]``).
      q: float ``[B, Hq, D]``.
      k, v: float ``[B, Hkv, N, D]``.
      budget: static; ``int >= 1`` draws, or ``float`` in ``(0, 1]`` fraction of
        each row's length (see :func:`budget_tokens`).
      lengths: int ``[B]`` valid keys per row (default N; clipped to [0, N]).
      softcap: None, or c in [0.001, 1e6]: each logit s becomes ``c * tanh(s / c)`` (Gemma 2's
        ``attn_logit_softcapping``) in ``w`` and in the LSE.

    Returns:
      ``(out, lse, num_distinct)``: out float32 ``[B, Hq, D]``; lse float32
      ``[B, Hq]``, the *exact* natural-log LSE over all valid logits (the oracle
      knows ``w``, so it knows its normalizer; with it the estimate merges with a
      disjoint part through :func:`merge_attention` like a dense result);
      num_distinct int32 ``[B, Hq]``, distinct keys drawn. An empty row gives
      ``0, -inf, 0``.

    Raises:
      ValueError: mismatched shapes, Hq not a multiple of Hkv, a budget or softcap out of range.
      TypeError: non-float q/k/v, non-integer lengths, a budget of the wrong type, or an ``rng``
        that is not one ``jax.random`` key.

    Source: arXiv 2410.16179, Section 3.2, Definition 3.1, Theorems 3.2 and 3.3.
    """
    check_prng_key("rng", rng)
    B, Hq, Hkv, N, D = check_qkv(q, k, v)
    check_budget(budget)
    softcap = check_softcap(softcap)
    lengths = check_lengths(lengths, B, N)
    logits = grouped_logits(q, k, softcap)
    valid = valid_mask(lengths, N)
    _, lse = masked_softmax_attention(logits, valid, v)
    draws = budget_tokens(budget, lengths)
    draws = jnp.where(lengths > 0, draws, 0)
    S = _max_budget_tokens(budget, N)
    if N == 0:
        return jnp.zeros((B, Hq, D), jnp.float32), lse, jnp.zeros((B, Hq), jnp.int32)
    G = Hq // Hkv
    lse_g = jnp.where(jnp.isfinite(lse), lse, 0.0).reshape(B, Hkv, G, 1)
    w = jnp.where(valid, jnp.exp(logits - lse_g), 0.0)  # [B, Hkv, G, N]
    idx = _inverse_cdf_draws(rng, w, S)
    used = (jnp.arange(S, dtype=jnp.int32)[None, :] < draws[:, None]).astype(jnp.float32)
    # a head whose every valid logit is -inf has no weight to draw from (w is all 0 and the inverse
    # CDF would land on position N - 1, padding included): no draws; its out is NaN below (a softmax
    # over only -inf logits) and its lse -inf
    drawable = (lse > -jnp.inf).reshape(B, Hkv, G, 1).astype(jnp.float32)
    used = used[:, None, None, :] * drawable
    counts = jax.vmap(lambda i, c: jnp.zeros((N,), jnp.float32).at[i].add(c))(
        idx.reshape(-1, S), used.reshape(-1, S)
    ).reshape(B, Hkv, G, N)
    num = selected_weighted_sum(counts, counts > 0, v)  # keys never drawn are selected out
    denom = jnp.maximum(draws, 1).astype(jnp.float32)[:, None, None, None]
    out = (num / denom).reshape(B, Hq, D)
    # a NaN or +inf logit makes the weights undefined, and so do valid logits that are all -inf: the
    # head is NaN (as the exact softmax's out is), not a finite mean of draws from the other keys
    undefined = jnp.isnan(lse) | ((lse == -jnp.inf) & (lengths > 0)[:, None])
    out = jnp.where(undefined[..., None], jnp.nan, out)
    num_distinct = jnp.sum(counts > 0, axis=-1, dtype=jnp.int32).reshape(B, Hq)
    return out, lse, num_distinct
