"""The host TopK op (magicpig_jax.host.topk) against float64 NumPy and the pure-JAX topk_attention:
same kept set (ties by position, GQA, per-row ranges and lengths, padding) and same output; its
errors; and the "topk" decode backend that runs it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magicpig_jax import host
from magicpig_jax.attention import MagicPIGConfig, topk_attention
from magicpig_jax.attention.baselines import budget_tokens
from magicpig_jax.host import host_topk_attention
from tests import _np_reference as np_ref

IMPLS = ["scalar", "avx2"] if host.has_avx2() else ["scalar"]
_topk = jax.jit(host_topk_attention, static_argnames=("budget", "impl", "max_threads", "softcap"))
CAPS = st.sampled_from([None, 0.5, 4.0])  # Gemma 2's soft-capping: None, binding, loose


def reference(q, k, v, budget, start, end):
    """float64: each head keeps the top min(budget_tokens, n) logits of [start, end) (ties by position)."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    B, Hq, _ = q.shape
    N = k.shape[2]
    keep = np.zeros((B, Hq, N), bool)
    for b in range(B):
        s, e = int(np.clip(start[b], 0, N)), int(np.clip(end[b], 0, N))
        e = max(e, s)
        n = e - s
        tokens = int(budget_tokens(budget, jnp.asarray([n], jnp.int32))[0])
        sub = np_ref.topk_keep(q[b:b + 1], k[b:b + 1, :, s:e], [tokens], [n])
        keep[b, :, s:e] = sub[0]
    return np_ref.selected(q, k, v, keep)


@st.composite
def problems(draw):
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 3))
    G = draw(st.integers(1, 4))
    N = draw(st.integers(0, 200))
    D = draw(st.sampled_from([1, 7, 8, 16, 33, 64]))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    ties = draw(st.booleans())  # small integers: many logits exactly equal
    starts = draw(st.lists(st.integers(-2, N + 2), min_size=B, max_size=B))
    ends = draw(st.lists(st.integers(-2, N + 2), min_size=B, max_size=B))
    budget = draw(st.one_of(st.integers(1, 250), st.sampled_from([0.01, 0.1, 0.37, 1.0])))
    seed = draw(st.integers(0, 2**31 - 1))
    return B, Hkv * G, Hkv, N, D, dtype, ties, starts, ends, budget, seed


def _data(B, Hq, Hkv, N, D, dtype, ties, seed):
    rng = np.random.default_rng(seed)
    if ties:
        q = rng.integers(-2, 3, (B, Hq, D)).astype(np.float32)
        k = rng.integers(-2, 3, (B, Hkv, N, D)).astype(np.float32)
    else:
        q = rng.standard_normal((B, Hq, D)).astype(np.float32) * 2
        k = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, N, D))
    return jnp.asarray(q), jnp.asarray(k, dtype), jnp.asarray(v, dtype)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=min(20, settings.default.max_examples))  # fewer than the default 100 (CI time)
@given(problems())
def test_matches_float64_reference(impl, p):
    B, Hq, Hkv, N, D, dtype, ties, starts, ends, budget, seed = p
    q, k, v = _data(B, Hq, Hkv, N, D, dtype, ties, seed)
    start, end = jnp.asarray(starts, jnp.int32), jnp.asarray(ends, jnp.int32)
    out, lse = _topk(q, k, v, budget, end, start=start, impl=impl)
    s = np.clip(starts, 0, N)
    e = np.maximum(np.clip(ends, 0, N), s)
    ref_out, ref_lse = reference(q, k, v, budget, s, e)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(ref_lse))
    fin = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=3e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], atol=3e-5, rtol=1e-5)


# (B, Hq, Hkv, N, D, dtype, ties, start, ends, budget): the pure-JAX function compiles per shape, so it is
# compared on these rather than on every random problem; one start for all rows (it takes a slice).
JAX_CASES = [  # and the soft-cap (None, or Gemma 2's c)
    (2, 4, 2, 150, 16, "float32", False, 3, [150, 80], 20, None),
    (1, 3, 1, 64, 1, "float32", True, 0, [64], 0.3, 0.5),
    (3, 2, 2, 97, 33, "bfloat16", False, 10, [97, 10, 50], 1.0, 2.0),
]


@pytest.mark.parametrize("max_threads", [0, 1])  # 0: scored in spans over the pool; 1: one KV head per item
@pytest.mark.parametrize("case", JAX_CASES)
def test_equals_pure_jax(case, max_threads):
    B, Hq, Hkv, N, D, dtype, ties, s0, ends, budget, cap = case
    q, k, v = _data(B, Hq, Hkv, N, D, dtype, ties, seed=len(ends))
    e = np.asarray(ends)
    out, lse = _topk(q, k, v, budget, jnp.asarray(e, jnp.int32), start=jnp.full((B,), s0, jnp.int32),
                     max_threads=max_threads, softcap=cap)
    j_out, j_lse = topk_attention(q, k[:, :, s0:], v[:, :, s0:], budget, jnp.asarray(e - s0, jnp.int32),
                                  softcap=cap)
    fin = np.isfinite(np.asarray(j_lse))
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(out), np.asarray(j_out), atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(j_lse)[fin], atol=2e-5, rtol=1e-5)


@given(problems(), CAPS)
def test_context_adds_the_static_set_in_one_softmax(p, cap):
    """With context, [0, start) and [end, context) join the kept keys: the merge of TopK and the static set
    (with a soft-cap, the kept set is the uncapped logits' and every logit of the softmax is capped)."""
    B, Hq, Hkv, N, D, dtype, ties, starts, ends, budget, seed = p
    q, k, v = _data(B, Hq, Hkv, N, D, dtype, ties, seed)
    rng = np.random.default_rng(seed + 1)
    s = np.clip(starts, 0, N)
    e = np.maximum(np.clip(ends, 0, N), s)
    ctx = np.asarray([rng.integers(int(x), N + 1) for x in e])
    out, lse = _topk(q, k, v, budget, jnp.asarray(e, jnp.int32), start=jnp.asarray(s, jnp.int32),
                     context=jnp.asarray(ctx, jnp.int32), softcap=cap)
    qf, kf = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k))
    keep = np.zeros((B, Hq, N), bool)
    for b in range(B):
        n = int(e[b] - s[b])
        tokens = int(budget_tokens(budget, jnp.asarray([n], jnp.int32))[0])
        keep[b, :, s[b]:e[b]] = np_ref.topk_keep(qf[b:b + 1], kf[b:b + 1, :, s[b]:e[b]], [tokens], [n])[0]
        keep[b, :, :s[b]] = True
        keep[b, :, e[b]:ctx[b]] = True
    ref_out, ref_lse = np_ref.selected(q, k, v, keep, cap)
    fin = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=3e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(lse)[fin], ref_lse[fin], atol=3e-5, rtol=1e-5)


def test_ties_keep_the_first_positions():
    """Eight identical keys, a budget of 3: the first three positions are kept (as the pure-JAX argsort)."""
    D = 4
    k = np.zeros((1, 1, 8, D), np.float32)
    k[..., 0] = 1.0
    v = np.zeros((1, 1, 8, D), np.float32)
    v[0, 0, :, 1] = np.arange(8)  # the output's column 1 is the mean position of the kept keys
    q = jnp.asarray([[[1.0, 0, 0, 0]]], jnp.float32)
    out, lse = host_topk_attention(q, jnp.asarray(k), jnp.asarray(v), 3)
    assert float(out[0, 0, 1]) == pytest.approx(1.0)  # positions 0, 1, 2
    j_out, _ = topk_attention(q, jnp.asarray(k), jnp.asarray(v), 3)
    np.testing.assert_allclose(np.asarray(out), np.asarray(j_out), atol=1e-6)


def test_long_range_and_one_thread():
    rng = np.random.default_rng(1)
    B, Hq, Hkv, N, D = 1, 9, 3, 20000, 64
    q = jnp.asarray(rng.standard_normal((B, Hq, D)) * 3, jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), jnp.float32)
    lengths = jnp.asarray([19_990], jnp.int32)
    out, lse = host_topk_attention(q, k, v, 0.02, lengths)
    ref_out, ref_lse = topk_attention(q, k, v, 0.02, lengths)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-5)
    out1, _ = host_topk_attention(q, k, v, 0.02, lengths, max_threads=1)
    np.testing.assert_allclose(np.asarray(out1), np.asarray(out), atol=1e-6)


def test_errors():
    q = jnp.zeros((1, 4, 8), jnp.float32)
    k = jnp.zeros((1, 2, 10, 8), jnp.float32)
    with pytest.raises(ValueError, match="budget"):
        host_topk_attention(q, k, k, 0)
    with pytest.raises(TypeError, match="float32 or both bfloat16"):
        host_topk_attention(q, k, k.astype(jnp.bfloat16), 3)
    with pytest.raises(ValueError, match="multiple"):
        host_topk_attention(jnp.zeros((1, 3, 8)), k, k, 3)
    with pytest.raises(ValueError, match="impl"):
        host_topk_attention(q, k, k, 3, impl="gpu")
    out, lse = host_topk_attention(q, k, k, 3, jnp.asarray([0]))  # an empty row
    assert float(jnp.abs(out).max()) == 0.0 and bool(jnp.all(lse == -jnp.inf))


# --- the decode backend -------------------------------------------------------------------------

def _decode(model, state, spec, n):
    from magicpig_jax.decode_loop import Sampling, run_decode

    outs, stats = run_decode(model, state, spec, n, Sampling())
    return outs, stats


def test_topk_backend_runs_the_host_op_and_equals_pure_jax():
    from magicpig_jax.generation import decode_spec, prefill
    from magicpig_jax.models.backends import backend_for
    from tests._tiny import tiny_model

    model = tiny_model(0)
    rng = np.random.default_rng(0)
    state = prefill(model, [list(rng.integers(1, 97, 600)), list(rng.integers(1, 97, 450))], 24)
    cfg = MagicPIGConfig(K=4, L=10, num_local=16)
    host_spec = decode_spec(model, "topk", cfg, None, 40)
    assert backend_for(host_spec).name == "topk (host op)" and host_spec.uses_host
    ref_spec = dataclasses.replace(host_spec, host=False)
    assert backend_for(ref_spec).name == "topk"
    out_h, stats_h = _decode(model, state, host_spec, 24)
    out_r, stats_r = _decode(model, state, ref_spec, 24)
    assert out_h == out_r
    assert stats_h["sampled_fraction_per_layer"] == pytest.approx(stats_r["sampled_fraction_per_layer"])


def test_topk_backend_moves_generated_tokens_into_the_range():
    """With a generation buffer of 4 the range grows every few steps; a budget of every key is dense."""
    from magicpig_jax.generation import decode_spec, prefill
    from tests._tiny import tiny_model

    model = tiny_model(1)
    rng = np.random.default_rng(1)
    state = prefill(model, [list(rng.integers(1, 97, 300))], 40)
    cfg = MagicPIGConfig(K=4, L=10, num_local=8)
    spec = dataclasses.replace(decode_spec(model, "topk", cfg, (), 1.0), generation_buffer=4)
    dense = decode_spec(model, "dense", cfg)
    assert _decode(model, state, spec, 40)[0] == _decode(model, state, dense, 40)[0]


@pytest.mark.parametrize("N", [9, 23, 5001])
def test_equal_keys_tie_to_the_smallest_position_on_every_path(N):
    """The AVX2 path scored the rows of a block of 8 and the rows left over in different summation
    orders, so equal keys scored a rounding apart and which copy TopK kept followed the blocking
    and the thread split (position 8 of 9; 312 or 5000 of 5001 by max_threads)."""
    from magicpig_jax.host import host_topk_attention

    D = 16
    for trial in range(8):
        rng = np.random.default_rng(trial)
        q = jnp.asarray(rng.standard_normal((1, 1, D)), jnp.float32)
        key = rng.standard_normal(D).astype(np.float32)
        k = jnp.asarray(np.broadcast_to(key, (1, 1, N, D)).copy())
        v = np.zeros((1, 1, N, D), np.float32)
        v[0, 0, :, 0] = np.arange(N)  # out[0] is the kept position
        for impl in IMPLS:
            for threads in (0, 1, 2):
                out = host_topk_attention(q, k, jnp.asarray(v), 1, impl=impl, max_threads=threads)[0]
                assert float(out[0, 0, 0]) == 0.0, (trial, impl, threads)
