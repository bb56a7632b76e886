"""Tests written against mutmut's mutants of ``magicpig_jax/attention/baselines.py`` (issue 18,
docs/mutation.md): TopK, Quest and oracle sampling, and their public helpers (``budget_tokens``,
``topk_mask``, ``quest_mask``, ``quest_page_scores``), against float64 NumPy references written
from the definitions, exact rationals, or cases computed by hand.

Oracle sampling is checked draw for draw: its documented sampling rule (one float32 uniform per
draw, of shape ``[B, Hq, n_max]`` from the key, located in the cumulative sum of the softmax
weights, ``side="right"``) is replayed in float64 NumPy on the same uniforms, with a margin check
that no uniform lies near a boundary of the cumulative sum (so float32 rounding cannot move a
draw).
"""

from __future__ import annotations

import fractions
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magicpig_jax.attention import budget_tokens, oracle_sampling_attention, quest_attention, topk_attention
from magicpig_jax.attention.baselines import quest_mask, quest_page_scores, topk_mask
from tests import _np_reference as ref
from tests._jitted import i32, oracle_j

pytestmark = pytest.mark.usefixtures("strict_jax")

# float budgets and the rational each stands for (the module docstring: the nearest num/den
# with den <= 32768; one more than 0.1% from it is refused)
RATIONALS = [
    (0.1, fractions.Fraction(1, 10)),
    (1 / 3, fractions.Fraction(1, 3)),
    (0.02, fractions.Fraction(1, 50)),
    (0.7, fractions.Fraction(7, 10)),
    (0.999, fractions.Fraction(999, 1000)),
    (0.5, fractions.Fraction(1, 2)),
    (1.0, fractions.Fraction(1, 1)),
    (2.0**-15, fractions.Fraction(1, 32768)),
    (0.5 + 2.0**-20, fractions.Fraction(1, 2)),
]


def _ceil(frac, n):
    return -((-frac.numerator * int(n)) // frac.denominator)


def _qkv(seed, B, Hq, Hkv, N, D, scale=1.0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, Hq, D)) * scale
    k = rng.normal(size=(B, Hkv, N, D)) * scale
    v = rng.normal(size=(B, Hkv, N, D))
    return q, k, v


def _f32(*xs):
    return tuple(jnp.asarray(x, jnp.float32) for x in xs)


def _pad(k, v, lengths, k_pad=50.0, v_pad=np.nan):
    """K rows past each length set to a large value (a key that would win every ranking and bound),
    V rows to NaN: a mutant that lets a padded key in changes or poisons the result."""
    k, v = np.array(k, np.float64), np.array(v, np.float64)
    for b, n in enumerate(lengths):
        k[b, :, n:] = k_pad
        v[b, :, n:] = v_pad
    return k, v


def _by_head(mask, Hkv):
    """``[B, Hq, N]`` reference mask as ``[B, Hkv, G, N]``."""
    B, Hq, N = mask.shape
    return mask.reshape(B, Hkv, Hq // Hkv, N)


def _page_scores_f64(q, k, page_size, lengths):
    """Quest's bound ``sum_d max(q_d min_d, q_d max_d) / sqrt(D)`` per page, float64; -inf for pages
    without a valid key. ``[B, Hkv, G, P]``."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G, P = Hq // Hkv, -(-N // page_size)
    out = np.full((B, Hkv, G, P), -np.inf)
    for b in range(B):
        for h in range(Hq):
            for j in range(P):
                seg = k[b, h // G, j * page_size : min((j + 1) * page_size, int(lengths[b]))]
                if len(seg):
                    lo, hi = seg.min(0), seg.max(0)
                    out[b, h // G, h % G, j] = np.maximum(q[b, h] * lo, q[b, h] * hi).sum() / math.sqrt(D)
    return out


def _oracle_f64(key, q, k, v, draws, n_max, lengths):
    """Oracle sampling replayed in float64: the same float32 uniforms ``[B, Hq, n_max]``, located in
    the float64 cumulative softmax weights of the valid keys (``side="right"``); the first
    ``draws[b]`` of them are row b's draws. Returns (out, lse, num_distinct, counts [B, Hq, N])."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    u = np.asarray(jax.random.uniform(key, (B, Hq, n_max), jnp.float32), np.float64)
    out, distinct = np.zeros((B, Hq, D)), np.zeros((B, Hq), np.int64)
    counts = np.zeros((B, Hq, N))
    for b in range(B):
        n = int(lengths[b])
        if n == 0:
            continue
        for h in range(Hq):
            logits = k[b, h // G, :n] @ q[b, h] / math.sqrt(D)
            w = np.exp(logits - logits.max())
            cdf = np.cumsum(w / w.sum())
            x = u[b, h, : draws[b]] * cdf[-1]
            # no draw within 1e-5 of a boundary: float32's cumulative sum locates it the same way
            assert np.min(np.abs(x[:, None] - cdf[None, :-1]), initial=1.0) > 1e-5
            idx = np.searchsorted(cdf, x, side="right")
            counts[b, h] = np.bincount(idx, minlength=N)
            out[b, h] = counts[b, h, :n] @ v[b, h // G, :n] / draws[b]
            distinct[b, h] = np.count_nonzero(counts[b, h])
    lse = ref.dense(q, k, v, lengths)[1]
    return out, lse, distinct, counts


# --- budget_tokens --------------------------------------------------------------------------


@jax.jit
def _tokens_j(lengths):
    """budget_tokens of every float budget of RATIONALS (one compilation per shape)."""
    return [budget_tokens(f, lengths) for f, _ in RATIONALS]


@settings(max_examples=40)
@given(lengths=st.lists(st.integers(0, 2**31 - 1), min_size=6, max_size=6))
def test_budget_tokens_is_the_exact_ceiling_of_the_rational(lengths):
    for got, (f, frac) in zip(_tokens_j(i32(lengths)), RATIONALS, strict=True):
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, [_ceil(frac, n) for n in lengths], err_msg=str(f))


def test_budget_tokens_every_residue_and_int_budgets():
    # every residue of the length modulo the denominators (the rounding of the exact ceiling)
    lengths = np.arange(0, 1000 + 3)
    for got, (f, frac) in zip(_tokens_j(i32(lengths)), RATIONALS, strict=True):
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, [_ceil(frac, n) for n in lengths], err_msg=str(f))
    got = budget_tokens(7, jnp.asarray([0, 3, 100], jnp.int16))  # int32 tokens; an int budget is not capped
    assert got.dtype == np.int32 and got.shape == (3,)
    np.testing.assert_array_equal(got, [7, 7, 7])
    got = budget_tokens(0.5, jnp.asarray([0, 3, 100], jnp.int16))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [0, 2, 50])


# --- TopK and Quest: masks, page scores and outputs --------------------------------------------

# B = 3 != Hq = 4, Hkv = 2, G = 2, N = 11 != D = 8; pages of 3: P = 4 (!= Hkv, G); the lengths
# 10 and 7 leave one key in their last page, and row 2 is empty
B, HQ, HKV, N, D = 3, 4, 2, 11, 8
LENGTHS = np.array([10, 7, 0])
BUDGETS = [1, 3, 5, 6, 7, 100, 0.5, 1 / 3, 1.0]
PAGES = [3, 4]


@jax.jit
def _masks_j(q, k, lengths):
    """topk_mask and quest_mask (pages of 3 and 4) for every budget of BUDGETS, in one program."""
    return (
        [topk_mask(q, k, b, lengths) for b in BUDGETS],
        [[quest_mask(q, k, ps, b, lengths) for b in BUDGETS] for ps in PAGES],
    )


@jax.jit
def _outputs_j(q, k, v, lengths):
    return (
        [topk_attention(q, k, v, b, lengths) for b in (5, 0.5)],
        [quest_attention(q, k, v, 3, b, lengths) for b in (5, 0.5)],
    )


@jax.jit
def _scores_j(q, k, lengths):
    return [quest_page_scores(q, k, ps, lengths) for ps in (1, 3, 4, 11, 12)]


def _tokens(budget, lengths):
    if isinstance(budget, int):
        return np.full(len(lengths), budget)
    frac = fractions.Fraction(budget).limit_denominator(1 << 15)
    return np.array([_ceil(frac, n) for n in lengths])


def _mask_case(seed):
    q, k, v = _qkv(seed, B, HQ, HKV, N, D, scale=1.3)
    k, v = _pad(k, v, LENGTHS)
    return q, k, v


def test_topk_and_quest_masks_and_outputs_against_float64():
    q, k, v = _mask_case(3)
    qj, kj, vj = _f32(q, k, v)
    lengths = i32(LENGTHS)
    topk, quest = _masks_j(qj, kj, lengths)
    for i, budget in enumerate(BUDGETS):
        tokens = _tokens(budget, LENGTHS)
        assert topk[i].dtype == np.bool_ and topk[i].shape == (B, HKV, HQ // HKV, N)
        np.testing.assert_array_equal(topk[i], _by_head(ref.topk_keep(q, k, tokens, LENGTHS), HKV), err_msg=str(budget))
        for j, page_size in enumerate(PAGES):
            want = _by_head(ref.quest_keep(q, k, page_size, tokens, LENGTHS), HKV)
            assert quest[j][i].dtype == np.bool_ and quest[j][i].shape == (B, HKV, HQ // HKV, N)
            np.testing.assert_array_equal(quest[j][i], want, err_msg=f"budget={budget}, page_size={page_size}")
    topk, quest = _outputs_j(qj, kj, vj, lengths)
    for i, budget in enumerate((5, 0.5)):
        tokens = _tokens(budget, LENGTHS)
        for (out, lse), keep in (
            (topk[i], ref.topk_keep(q, k, tokens, LENGTHS)),
            (quest[i], ref.quest_keep(q, k, 3, tokens, LENGTHS)),
        ):
            r_out, r_lse = ref.selected(q, k, v, keep)
            np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(lse, r_lse, rtol=1e-6, atol=1e-6)


def test_quest_page_scores_are_the_float64_bound():
    q, k, _ = _mask_case(4)
    for page_size, got in zip((1, 3, 4, 11, 12), _scores_j(*_f32(q, k), i32(LENGTHS)), strict=True):
        assert got.dtype == np.float32 and got.shape == (B, HKV, HQ // HKV, -(-N // page_size))
        want = _page_scores_f64(q, k, page_size, LENGTHS)
        np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@jax.jit
def _ties_j(q, k, v, lengths):
    return topk_mask(q, k, 10, lengths), quest_mask(q, k, 2, 10, lengths), topk_attention(q, k, v, 10, lengths)


def test_ties_are_broken_by_position_and_by_page():
    # 40 keys with one logit: TopK keeps the first `budget` positions, Quest the first pages (an
    # unstable sort or an ascending one keeps others)
    Nt = 40
    q = np.ones((1, 2, 4))
    k = np.ones((1, 1, Nt, 4))
    v = np.random.default_rng(5).normal(size=(1, 1, Nt, 4))
    want = np.zeros((1, 1, 2, Nt), bool)
    want[..., :10] = True
    topk, quest, (out, lse) = _ties_j(*_f32(q, k, v), i32([Nt]))
    np.testing.assert_array_equal(topk, want)
    np.testing.assert_array_equal(quest, want)
    np.testing.assert_allclose(out, np.broadcast_to(v[0, 0, :10].mean(0), (1, 2, 4)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, np.full((1, 2), 2.0 + math.log(10)), rtol=1e-6)


PROPERTY_BUDGETS = [1, 4, 9, 0.3, 1.0]


@jax.jit
def _property_masks_j(q, k, lengths):
    return (
        [topk_mask(q, k, b, lengths) for b in PROPERTY_BUDGETS],
        [[quest_mask(q, k, ps, b, lengths) for b in PROPERTY_BUDGETS] for ps in (2, 5)],
    )


@settings(max_examples=25)
@given(seed=st.integers(0, 2**32 - 1), lengths=st.lists(st.integers(0, 13), min_size=2, max_size=2))
def test_topk_and_quest_masks_property(seed, lengths):
    q, k, _ = _qkv(seed, 2, 2, 1, 13, 4)
    k, _ = _pad(k, np.zeros_like(k), lengths)
    lengths = np.asarray(lengths)
    topk, quest = _property_masks_j(*_f32(q, k), i32(lengths))
    for i, budget in enumerate(PROPERTY_BUDGETS):
        tokens = _tokens(budget, lengths)
        np.testing.assert_array_equal(topk[i], _by_head(ref.topk_keep(q, k, tokens, lengths), 1))
        for j, page_size in enumerate((2, 5)):
            want = _by_head(ref.quest_keep(q, k, page_size, tokens, lengths), 1)
            np.testing.assert_array_equal(quest[j][i], want)


# --- oracle sampling --------------------------------------------------------------------------

# budget, draws per row, n_max (the uniforms' last axis: the budget, or ceil(f * N))
ORACLE = [(1, [1, 1, 1, 0], 1), (7, [7, 7, 7, 0], 7), (0.5, [5, 3, 1, 0], 5), (1.0, [9, 6, 1, 0], 9)]


@jax.jit
def _oracles_j(key, q, k, v, lengths):
    return [oracle_sampling_attention(key, q, k, v, b, lengths) for b, _, _ in ORACLE]


def test_oracle_sampling_draw_for_draw_against_float64():
    # rows: full (9 keys, logits shifted by about +90: exp(logit + lse) would overflow), 6 of 9
    # (padding: large keys, NaN values), a single key, empty. Budgets: one draw (the mean of one
    # value), more draws than keys, fractions.
    Bo, Hq, Hkv, No, Do = 4, 4, 2, 9, 8
    q, k, v = _qkv(11, Bo, Hq, Hkv, No, Do)
    q[0] = np.abs(q[0])
    k[0] += 40.0
    lengths = [9, 6, 1, 0]
    k, v = _pad(k, v, lengths)
    key = jax.random.key(21)
    for (budget, draws, n_max), (out, lse, distinct) in zip(
        ORACLE, _oracles_j(key, *_f32(q, k, v), i32(lengths)), strict=True
    ):
        r_out, r_lse, r_distinct, _ = _oracle_f64(key, q, k, v, draws, n_max, lengths)
        assert (out.dtype, lse.dtype, distinct.dtype) == (np.float32, np.float32, np.int32)
        np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-5, err_msg=str(budget))
        np.testing.assert_allclose(lse, r_lse, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(distinct, r_distinct, err_msg=str(budget))


def test_oracle_sampling_draws_the_last_key_after_zero_weight_keys():
    # logit = q . k / sqrt(D) = k[..., 0] for q = sqrt(D) e_0. Row 0: key 0 has weight 0 in float32
    # (logit -200) and key 7, the last, most of the weight; row 1 (length 7): key 5 has weight 0 and
    # key 6, the last valid one, most of the weight. Draws of the last positive key stay there.
    Do, No = 4, 8
    q = np.zeros((2, 1, Do))
    q[:, :, 0] = math.sqrt(Do)
    k = np.zeros((2, 1, No, Do))
    k[0, 0, :, 0] = [-200, 0, 0, 0, 0, 0, 0, 3]
    k[1, 0, :, 0] = [0, 0, 0, 0, 0, -200, 3, 0]
    v = np.random.default_rng(6).normal(size=(2, 1, No, Do))
    lengths = [8, 7]
    key = jax.random.key(2)
    out, lse, distinct = oracle_j(key, *_f32(q, k, v), 32, i32(lengths))
    r_out, r_lse, r_distinct, counts = _oracle_f64(key, q, k, v, [32, 32], 32, lengths)
    assert counts[0, 0, 7] > 0 and counts[1, 0, 6] > 0 and counts[0, 0, 0] == 0 and counts[1, 0, 5] == 0
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-6)
    np.testing.assert_array_equal(distinct, r_distinct)


@jax.jit
def _small_j(key, q, k, v, lengths, q0, k0, v0):
    return (
        [
            topk_attention(q, k, v, 1, lengths),
            quest_attention(q, k, v, 1, 3, lengths),
            oracle_sampling_attention(key, q, k, v, 2, lengths),
        ],
        [
            topk_attention(q0, k0, v0, 3, jnp.zeros((2,), jnp.int32)),
            quest_attention(q0, k0, v0, 2, 3),
            oracle_sampling_attention(key, q0, k0, v0, 0.5),
            oracle_sampling_attention(key, q0, k0, v0, 4),
        ],
    )


def test_one_key_and_no_key():
    # N = 1: every estimator is the one valid key's value (or 0, -inf for an empty row); N = 0: 0, -inf.
    # The lengths 5 and -2 are clipped to 1 and 0.
    q, k, v = _qkv(7, 2, 2, 1, 1, 4)
    want = np.stack([np.broadcast_to(v[0, 0, 0], (2, 4)), np.zeros((2, 4))])
    want_lse = np.array([q[0] @ k[0, 0, 0] / 2.0, [-np.inf, -np.inf]])
    one, none = _small_j(jax.random.key(0), *_f32(q, k, v), i32([5, -2]), *_f32(*_qkv(7, 2, 2, 1, 0, 4)))
    for res in one:
        np.testing.assert_allclose(res[0], want, rtol=1e-6)
        np.testing.assert_allclose(res[1], want_lse, rtol=1e-6)
    np.testing.assert_array_equal(one[2][2], [[1, 1], [0, 0]])
    for res in none:
        assert tuple(x.dtype for x in res) == (np.float32, np.float32, np.int32)[: len(res)]
        np.testing.assert_array_equal(res[0], np.zeros((2, 2, 4)))
        assert np.all(np.isneginf(res[1])) and res[1].shape == (2, 2)
    np.testing.assert_array_equal(none[2][2], np.zeros((2, 2)))


# --- x64 ----------------------------------------------------------------------------------------


def _x64(key, q, k, v, len64, len32, q0, k0, v0):
    return {
        "tokens": (budget_tokens(5, len64), budget_tokens(0.5, len64)),
        "topk_mask": topk_mask(q, k, 4, len32),
        "quest_mask": quest_mask(q, k, 3, 0.5, len32),
        "scores": quest_page_scores(q, k, 3, len32),
        "topk": topk_attention(q, k, v, 4, len64),
        "quest": quest_attention(q, k, v, 3, 0.5, len64),
        "oracle": oracle_sampling_attention(key, q, k, v, 0.5, len64),
        "empty": [
            topk_attention(q0, k0, v0, 3),
            quest_attention(q0, k0, v0, 2, 3),
            oracle_sampling_attention(key, q0, k0, v0, 2),
        ],
    }


def test_baselines_under_x64_keep_int32_float32_and_warn_nothing():
    # under x64 the default int is int64 and the default float float64: a dtype left to its
    # default is refused under strict promotion, comes out 64-bit, or is cast into a 32-bit buffer
    # with JAX's FutureWarning (an error in later releases) -- here an error
    q, k, v = _mask_case(8)
    n = LENGTHS
    key = jax.random.key(5)
    with jax.enable_x64(True), warnings.catch_warnings():
        warnings.simplefilter("error")
        res = jax.jit(_x64)(
            key, *_f32(q, k, v), jnp.asarray(n, jnp.int64), i32(n), *_f32(*_qkv(7, 2, 2, 1, 0, 4))
        )
    tok_int, tok_frac = res["tokens"]
    assert tok_int.dtype == np.int32 and tok_frac.dtype == np.int32
    np.testing.assert_array_equal(tok_int, [5, 5, 5])
    np.testing.assert_array_equal(tok_frac, [5, 4, 0])
    np.testing.assert_array_equal(res["topk_mask"], _by_head(ref.topk_keep(q, k, [4] * 3, n), HKV))
    np.testing.assert_array_equal(res["quest_mask"], _by_head(ref.quest_keep(q, k, 3, [5, 4, 0], n), HKV))
    assert res["scores"].dtype == np.float32
    np.testing.assert_allclose(res["scores"], _page_scores_f64(q, k, 3, n), rtol=1e-5, atol=1e-5)
    for name, keep in (("topk", ref.topk_keep(q, k, [4] * 3, n)), ("quest", ref.quest_keep(q, k, 3, [5, 4, 0], n))):
        out, lse = res[name]
        assert out.dtype == np.float32 and lse.dtype == np.float32
        r_out, r_lse = ref.selected(q, k, v, keep)
        np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse, r_lse, rtol=1e-6, atol=1e-6)
    r_out, r_lse, r_distinct, _ = _oracle_f64(key, q, k, v, [5, 4, 0], 6, n)
    out, lse, distinct = res["oracle"]
    assert (out.dtype, lse.dtype, distinct.dtype) == (np.float32, np.float32, np.int32)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(distinct, r_distinct)
    for r in res["empty"]:
        assert tuple(x.dtype for x in r) == (np.float32, np.float32, np.int32)[: len(r)]
        np.testing.assert_array_equal(r[0], 0.0)
        assert np.all(np.isneginf(r[1]))
    np.testing.assert_array_equal(res["empty"][2][2], 0)
