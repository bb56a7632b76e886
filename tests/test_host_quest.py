"""The host Quest op (magicpig_jax.host.quest) against float64 NumPy and the pure-JAX quest_attention:
same pages (ties by page, GQA, per-row ranges, partial last pages, padding) and same output; the
page bounds built after prefill and extended as keys join the range; the "quest" decode backend."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magicpig_jax import host
from magicpig_jax.attention import MagicPIGConfig, quest_attention
from magicpig_jax.attention.baselines import budget_tokens
from magicpig_jax.host import QuestPages, host_quest_attention, quest_append_pages, quest_build_pages
from tests import _np_reference as np_ref

IMPLS = ["scalar", "avx2"] if host.has_avx2() else ["scalar"]
_quest = jax.jit(host_quest_attention, static_argnames=("budget", "impl", "max_threads", "softcap"))
CAPS = st.sampled_from([None, 0.5, 4.0])  # Gemma 2's soft-capping: None, binding, loose


def reference(q, k, v, page_size, budget, start, end):
    """float64 Quest over [start, end) of each row, pages from start (np_ref.quest_keep on the slice)."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    B, Hq, _ = q.shape
    N = k.shape[2]
    keep = np.zeros((B, Hq, N), bool)
    for b in range(B):
        s, e = int(start[b]), int(end[b])
        n = e - s
        tokens = int(budget_tokens(budget, jnp.asarray([n], jnp.int32))[0])
        keep[b, :, s:e] = np_ref.quest_keep(q[b:b + 1], k[b:b + 1, :, s:e], page_size, [tokens], [n])[0]
    return np_ref.selected(q, k, v, keep)


@st.composite
def problems(draw):
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 3))
    G = draw(st.integers(1, 4))
    N = draw(st.integers(1, 200))
    D = draw(st.sampled_from([1, 7, 8, 16, 33]))
    page = draw(st.sampled_from([1, 3, 16]))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    ties = draw(st.booleans())
    starts = draw(st.lists(st.integers(0, N), min_size=B, max_size=B))
    ends = draw(st.lists(st.integers(0, N), min_size=B, max_size=B))
    budget = draw(st.one_of(st.integers(1, 250), st.sampled_from([0.05, 0.3, 1.0])))
    seed = draw(st.integers(0, 2**31 - 1))
    return B, Hkv * G, Hkv, N, D, page, dtype, ties, starts, ends, budget, seed


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=min(20, settings.default.max_examples))  # fewer than the default 100 (CI time)
@given(problems())
def test_matches_float64_reference(impl, p):
    B, Hq, Hkv, N, D, page, dtype, ties, starts, ends, budget, seed = p
    rng = np.random.default_rng(seed)
    if ties:  # small integers: identical pages and keys, bounds exactly equal
        q = jnp.asarray(rng.integers(-2, 3, (B, Hq, D)), jnp.float32)
        k = jnp.asarray(rng.integers(-1, 2, (B, Hkv, N, D)), dtype)
    else:
        q = jnp.asarray(rng.standard_normal((B, Hq, D)) * 2, jnp.float32)
        k = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), dtype)
    s = np.asarray(starts)
    e = np.maximum(np.asarray(ends), s)
    pages = quest_build_pages(k, jnp.asarray(s, jnp.int32), jnp.asarray(e, jnp.int32), page)
    out, lse = _quest(q, k, v, pages, budget, impl=impl)
    ref_out, ref_lse = reference(q, k, v, page, budget, s, e)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=3e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], atol=3e-5, rtol=1e-5)


# (B, Hkv, G, N, D, page, dtype, ties, start, ends, budget): the pure-JAX function compiles per shape,
# so it is compared on these rather than on every random problem; one start for all rows.
JAX_CASES = [  # and the soft-cap (None, or Gemma 2's c)
    (2, 2, 2, 150, 16, 16, "float32", False, 3, [150, 80], 40, 2.0),
    (1, 1, 3, 64, 1, 3, "float32", True, 0, [64], 0.3, None),
    (3, 2, 1, 97, 33, 1, "bfloat16", False, 10, [97, 10, 50], 1.0, 0.5),
]


@pytest.mark.parametrize("case", JAX_CASES)
def test_equals_pure_jax(case):
    B, Hkv, G, N, D, page, dtype, ties, s0, ends, budget, cap = case
    rng = np.random.default_rng(len(ends))
    if ties:
        q = jnp.asarray(rng.integers(-2, 3, (B, Hkv * G, D)), jnp.float32)
        k = jnp.asarray(rng.integers(-1, 2, (B, Hkv, N, D)), dtype)
    else:
        q = jnp.asarray(rng.standard_normal((B, Hkv * G, D)) * 2, jnp.float32)
        k = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), dtype)
    e = np.asarray(ends)
    pages = quest_build_pages(k, jnp.full((B,), s0, jnp.int32), jnp.asarray(e, jnp.int32), page)
    out, lse = _quest(q, k, v, pages, budget, softcap=cap)
    j_out, j_lse = quest_attention(q, k[:, :, s0:], v[:, :, s0:], page, budget, jnp.asarray(e - s0, jnp.int32),
                                   softcap=cap)
    fin = np.isfinite(np.asarray(j_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(out), np.asarray(j_out), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(j_lse)[fin], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("budget", [16, 1.0])
@pytest.mark.parametrize("component, q_sign, finite", [
    (np.inf, -1, True), (-np.inf, 1, True),  # the key's logit is -inf: weight 0, its page's bound finite
    (np.inf, 1, False), (-np.inf, -1, False), (np.inf, 0, False),  # logit +inf, or 0 * inf: NaN
])
def test_a_key_with_an_infinite_component(impl, budget, component, q_sign, finite):
    """Where q_d has the other sign, a key's infinite component makes its logit -inf: it weighs
    nothing, as in dense attention, and its page's bound sum_d max(q_d kmin_d, q_d kmax_d) stays
    finite (as q+ . kmax + q- . kmin it was 0 * inf = NaN, and the host op poisoned the head while
    the pure function kept the page). Host, pure JAX and float64 agree; a logit of +inf or NaN
    gives every head NaN in both."""
    rng = np.random.default_rng(7)
    B, Hkv, G, N, D, page = 1, 1, 2, 64, 8, 8
    q = rng.standard_normal((B, Hkv * G, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    k[0, 0, 10, 3] = component
    q[0, :, 3] = q_sign * np.abs(q[0, :, 3])
    pages = quest_build_pages(jnp.asarray(k), jnp.zeros(B, jnp.int32), jnp.full(B, N, jnp.int32), page)
    out, lse = _quest(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), pages, budget, impl=impl)
    j_out, j_lse = quest_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), page, budget)
    if not finite:
        assert np.isnan(np.asarray(lse)).all() and np.isnan(np.asarray(j_lse)).all()
        return
    ref_out, ref_lse = reference(q, k, v, page, budget, [0], [N])
    for got_out, got_lse in ((out, lse), (j_out, j_lse)):
        np.testing.assert_allclose(np.asarray(got_out), ref_out, atol=3e-5, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(got_lse), ref_lse, atol=3e-5, rtol=1e-5)


@settings(max_examples=min(20, settings.default.max_examples))  # fewer than the default 100 (CI time)
@given(problems(), CAPS)
def test_context_adds_the_static_set_in_one_softmax(p, cap):
    """With context, [0, start) and [end, context) join the kept pages' keys in one softmax (with a
    soft-cap, the pages are the uncapped bounds' and every logit of the softmax is capped)."""
    B, Hq, Hkv, N, D, page, dtype, ties, starts, ends, budget, seed = p
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, Hq, D)) * 2, jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), dtype)
    s = np.asarray(starts)
    e = np.maximum(np.asarray(ends), s)
    ctx = np.asarray([rng.integers(int(x), N + 1) for x in e])
    pages = quest_build_pages(k, jnp.asarray(s, jnp.int32), jnp.asarray(e, jnp.int32), page)
    out, lse = _quest(q, k, v, pages, budget, context=jnp.asarray(ctx, jnp.int32), softcap=cap)
    qf, kf = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k))
    keep = np.zeros((B, Hq, N), bool)
    for b in range(B):
        n = int(e[b] - s[b])
        tokens = int(budget_tokens(budget, jnp.asarray([n], jnp.int32))[0])
        keep[b, :, s[b]:e[b]] = np_ref.quest_keep(qf[b:b + 1], kf[b:b + 1, :, s[b]:e[b]], page, [tokens], [n])[0]
        keep[b, :, :s[b]] = True
        keep[b, :, e[b]:ctx[b]] = True
    ref_out, ref_lse = np_ref.selected(q, k, v, keep, cap)
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=3e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], atol=3e-5, rtol=1e-5)


@settings(max_examples=min(20, settings.default.max_examples))  # fewer than the default 100 (CI time)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 5, 16]), st.sampled_from([1, 7, 40]))  # max_count is static
def test_append_equals_a_rebuild(seed, page, max_count):
    rng = np.random.default_rng(seed)
    B, Hkv, N, D = 3, 2, 120, 5
    k = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), jnp.float32)
    start = jnp.asarray(rng.integers(0, 10, B), jnp.int32)
    end = start + jnp.asarray(rng.integers(0, 60, B), jnp.int32)
    counts = jnp.asarray(rng.integers(0, max_count + 1, B), jnp.int32)
    pages = quest_build_pages(k, start, end, page, capacity=N)
    grown = quest_append_pages(pages, k, counts, max_count)
    again = quest_build_pages(k, start, end + counts, page, capacity=N)
    np.testing.assert_array_equal(np.asarray(grown.end), np.asarray(end + counts))
    np.testing.assert_array_equal(np.asarray(grown.kmin), np.asarray(again.kmin))
    np.testing.assert_array_equal(np.asarray(grown.kmax), np.asarray(again.kmax))


def test_bounds_are_the_page_min_and_max():
    k = jnp.asarray(np.arange(2 * 10 * 3, dtype=np.float32).reshape(1, 2, 10, 3))
    pages = quest_build_pages(k, jnp.asarray([1]), jnp.asarray([8]), 4, capacity=10)
    assert isinstance(pages, QuestPages) and pages.kmin.shape == (1, 2, 3, 3)
    np.testing.assert_array_equal(np.asarray(pages.kmin[0, 0, :2]), np.asarray(k[0, 0, [1, 5]]))
    np.testing.assert_array_equal(np.asarray(pages.kmax[0, 0, :2]), np.asarray(k[0, 0, [4, 7]]))
    assert bool(jnp.all(pages.kmin[0, :, 2] == jnp.inf))  # past the range


def test_errors():
    q = jnp.zeros((1, 4, 8), jnp.float32)
    k = jnp.zeros((1, 2, 40, 8), jnp.float32)
    pages = quest_build_pages(k, jnp.asarray([0]), jnp.asarray([40]), 16)
    with pytest.raises(ValueError, match="budget"):
        host_quest_attention(q, k, k, pages, 0)
    with pytest.raises(TypeError, match="QuestPages"):
        host_quest_attention(q, k, k, (pages.kmin, pages.kmax), 4)
    small = quest_build_pages(k[:, :, :8], jnp.asarray([0]), jnp.asarray([8]), 16)
    grown = dataclasses.replace(small, end=jnp.asarray([40]))  # more pages than the bounds hold
    with pytest.raises(Exception, match="more pages"):
        jax.block_until_ready(host_quest_attention(q, k, k, grown, 4))


def test_quest_backend_runs_the_host_op_and_equals_pure_jax():
    from magicpig_jax.decode_loop import Sampling, run_decode
    from magicpig_jax.generation import decode_spec, prefill
    from magicpig_jax.models.backends import backend_for
    from tests._tiny import tiny_model

    model = tiny_model(0)
    rng = np.random.default_rng(2)
    state = prefill(model, [list(rng.integers(1, 97, 640)), list(rng.integers(1, 97, 400))], 24)
    cfg = MagicPIGConfig(K=4, L=10, num_local=16)
    host_spec = decode_spec(model, "quest", cfg, None, 48, 16)
    assert backend_for(host_spec).name == "quest (host op)"
    ref_spec = dataclasses.replace(host_spec, host=False)
    out_h, _ = run_decode(model, state, host_spec, 24, Sampling())
    out_r, _ = run_decode(model, state, ref_spec, 24, Sampling())
    assert out_h == out_r
    # the range grows as tokens are generated (buffer of 4); every page kept: dense
    spec = dataclasses.replace(decode_spec(model, "quest", cfg, (), 1.0, 16), generation_buffer=4)
    dense = decode_spec(model, "dense", cfg)
    assert run_decode(model, state, spec, 40, Sampling())[0] == run_decode(model, state, dense, 40, Sampling())[0]
