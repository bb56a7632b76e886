"""Non-finite inputs never give a silent answer.

A NaN or infinite key (an overflowed activation, a corrupt checkpoint) makes the sparse selections
undefined: TopK's top set, Quest's page bounds, MagicPIG's centering mean. Each host op then
returns NaN for the heads that read it, as the pure-JAX references' outputs are (before, the host
ops left the key out or reported the head empty: finite and wrong). The decode loop turns NaN
logits into a ``FloatingPointError`` naming the token and rows, for every backend.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magicpig_jax import host
from magicpig_jax.attention import MagicPIGConfig, quest_attention, topk_attention
from magicpig_jax.decode_loop import Sampling, start_decode
from magicpig_jax.generation import prefill
from magicpig_jax.host.quest import host_quest_attention, quest_build_pages
from magicpig_jax.host.topk import host_topk_attention
from magicpig_jax.models.backends import DecodeSpec
from tests._tiny import tiny_model

IMPLS = ["scalar", "avx2"] if host.has_avx2() else ["scalar"]


def _qkv(bad_pos: int, bad):
    r = jax.random.split(jax.random.key(0), 3)
    k = jax.random.normal(r[0], (1, 2, 600, 16)).at[0, 0, bad_pos, 3].set(bad)  # KV head 0 only
    return jax.random.normal(r[2], (1, 4, 16)), k, jax.random.normal(r[1], (1, 2, 600, 16))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_topk_op_gives_nan_for_a_head_whose_range_holds_a_non_finite_key(impl, bad):
    q, k, v = _qkv(300, bad)
    q = q.at[:, :, 3].set(1.0)  # every head's logit for the bad key is NaN or +inf
    lengths = jnp.array([600])
    out, lse = host_topk_attention(q, k, v, 32, lengths, impl=impl)
    ref, _ = topk_attention(q, k, v, 32, lengths)
    assert np.isnan(np.asarray(out[0, :2])).all() and np.isnan(np.asarray(lse[0, :2])).all()
    assert not np.isfinite(np.asarray(ref[0, :2])).all()  # the reference is not finite either
    np.testing.assert_allclose(np.asarray(out[0, 2:]), np.asarray(ref[0, 2:]), atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_quest_op_gives_nan_for_a_head_whose_pages_hold_a_non_finite_key(impl):
    q, k, v = _qkv(300, np.nan)
    lengths = jnp.array([600])
    pages = quest_build_pages(k, jnp.array([0]), lengths, 16)
    out, lse = host_quest_attention(q, k, v, pages, 64, impl=impl)
    ref, _ = quest_attention(q, k, v, 16, 64, lengths)
    assert np.isnan(np.asarray(out[0, :2])).all() and np.isnan(np.asarray(lse[0, :2])).all()
    np.testing.assert_allclose(np.asarray(out[0, 2:]), np.asarray(ref[0, 2:]), atol=1e-5)


@pytest.mark.parametrize("backend", ["dense", "magicpig", "magicpig-ref", "topk", "quest"])
def test_decode_raises_on_nan_logits_instead_of_choosing_a_token(backend):
    """A NaN in one row's cache of one layer: that row's logits are NaN at the first step, whatever
    the backend (the host ops used to hide it); the run raises naming the row, not token 0."""
    model = tiny_model(0)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, 90, 300)], [int(t) for t in rng.integers(1, 90, 250)]]
    state = prefill(model, prompts, 8)
    ks = list(state.cache.k)
    ks[1] = ks[1].at[1, 0, 100, 0].set(jnp.nan)  # layer 1 (sparse for the sparse backends), row 1
    state.cache.k = tuple(ks)
    spec = DecodeSpec(backend=backend, magicpig=MagicPIGConfig(K=6, L=20, num_sink=2, num_local=8),
                      dense_layers=None if backend == "dense" else (0,),
                      budget=32 if backend in ("topk", "quest") else None)
    run = start_decode(model, state, spec, 8, Sampling())
    with pytest.raises(FloatingPointError, match=r"new token 1 of row\(s\) \[1\] contain NaN"):
        for _ in run:
            pass


def test_nan_logits_from_the_prefill_raise_before_any_step():
    model = tiny_model(0)
    state = prefill(model, [[5, 6, 7, 8]], 4)
    state.last_logits = state.last_logits.at[0, 3].set(jnp.nan)
    with pytest.raises(FloatingPointError, match=r"new token 0 of row\(s\) \[0\]"):
        for _ in start_decode(model, state, DecodeSpec(backend="dense"), 4, Sampling(temperature=0.7)):
            pass


def test_a_nan_key_in_the_prefill_reaches_its_queries_and_only_them():
    """XLA's CPU max skips NaN, so the block's softmax sum is NaN: the prefill kept such a block
    as empty (dropped, valid keys included), which gave finite zeros, finite logits and a token."""
    from magicpig_jax.models.decoding import _causal_block_attention

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 2, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1, 8, 16)).astype(np.float32)
    v = rng.standard_normal((1, 1, 8, 16)).astype(np.float32)
    k[0, 0, 3, 0] = np.nan  # seen by the queries at positions 3..7, causally
    out = np.asarray(_causal_block_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), 0, 4))
    assert np.isnan(out[0, 3:]).all()
    s = np.einsum("chd,nd->hcn", q[0, :3].astype(np.float64), k[0, 0, :3].astype(np.float64)) / 4.0
    s = np.where(np.arange(3)[None, None, :] <= np.arange(3)[None, :, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    ref = np.einsum("hcn,nd->chd", p / p.sum(-1, keepdims=True), v[0, 0, :3].astype(np.float64))
    np.testing.assert_allclose(out[0, :3], ref, rtol=1e-5, atol=1e-6)


def test_a_nan_weight_gives_nan_prefill_logits_and_the_run_raises():
    model = tiny_model(0)
    w = model.module.layers[1].self_attn.q_proj.kernel
    w[...] = w[...].at[0, 0].set(jnp.nan)
    state = prefill(model, [[5, 6, 7, 8, 9, 10]], 4)
    assert not np.isfinite(np.asarray(state.last_logits)).any()
    with pytest.raises(FloatingPointError, match=r"new token 0 of row\(s\) \[0\]"):
        for _ in start_decode(model, state, DecodeSpec(backend="dense"), 4, Sampling()):
            pass


def test_quest_page_bounds_carry_a_nan_key_through_build_and_append():
    """XLA's CPU min/max reductions skip NaN; the bounds must not (a finite bound would let the op
    leave the key out unseen)."""
    from magicpig_jax.host.quest import quest_append_pages

    k = jnp.asarray(np.random.default_rng(1).standard_normal((1, 1, 64, 4)), jnp.float32)
    k = k.at[0, 0, 5, 2].set(jnp.nan).at[0, 0, 40, 1].set(jnp.nan)
    pages = quest_build_pages(k, jnp.array([0]), jnp.array([32]), 16, capacity=64)
    kmin = np.asarray(pages.kmin)[0, 0]
    assert np.isnan(kmin[0, 2]) and np.isnan(np.asarray(pages.kmax)[0, 0, 0, 2])
    assert np.isfinite(np.delete(kmin[:2], 2, axis=1)).all() and np.isfinite(kmin[0, [0, 1, 3]]).all()
    grown = quest_append_pages(pages, k, jnp.array([16]), 16)  # positions 32..47: the NaN at 40
    assert np.isnan(np.asarray(grown.kmin)[0, 0, 2, 1]) and np.isnan(np.asarray(grown.kmax)[0, 0, 2, 1])
    assert np.isfinite(np.asarray(grown.kmin)[0, 0, 2, [0, 2, 3]]).all()


def test_pure_jax_dense_and_merge_keep_nan_apart_from_empty():
    """dense_attention over a NaN key gives lse NaN (it gave -inf, the mark of an empty row), and
    merge_attention keeps a NaN part NaN while an empty part (-inf) still contributes nothing."""
    from magicpig_jax.attention import dense_attention, merge_attention

    q, k, v = _qkv(300, np.nan)
    out, lse = dense_attention(q, k, v)
    assert np.isnan(np.asarray(lse[0, :2])).all() and np.isfinite(np.asarray(lse[0, 2:])).all()
    o = jnp.ones((2, 3))
    m_out, m_lse = merge_attention(o, jnp.array([jnp.nan, 0.0]), 2 * o, jnp.array([0.0, -jnp.inf]))
    assert np.isnan(np.asarray(m_out[0])).all() and np.isnan(float(m_lse[0]))
    np.testing.assert_allclose(np.asarray(m_out[1]), 1.0)
    assert float(m_lse[1]) == 0.0


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_hybrid_gives_nan_like_magicpig_for_a_non_finite_key_in_the_hashed_range(bad):
    """An infinite key made the hybrid's light weights 1e30 (log u_c of a NaN cosine read as -inf,
    then floored): a finite, wrong answer where MagicPIG gives NaN."""
    from magicpig_jax import lsh
    from magicpig_jax.attention import HybridConfig, build_lsh_index, hybrid_attention, magicpig_attention
    from magicpig_jax.attention.hybrid import log_light_probability

    q, k, v = _qkv(300, bad)
    cfg = HybridConfig(K=3, L=10, num_sink=4, num_local=8, heavy=5)
    index = build_lsh_index(k, lsh.simhash_projections(jax.random.key(1), 16, 3, 10), cfg)
    out, lse, _ = hybrid_attention(q, k, v, index, cfg)
    ref_out, ref_lse, _ = magicpig_attention(q, k, v, index, MagicPIGConfig(K=3, L=10, num_sink=4, num_local=8))
    assert np.isnan(np.asarray(out[0, :2])).all() and np.isnan(np.asarray(lse[0, :2])).all()
    np.testing.assert_array_equal(np.isnan(np.asarray(lse)), np.isnan(np.asarray(ref_lse)))
    assert np.isfinite(np.asarray(out[0, 2:])).all()
    assert np.isnan(float(log_light_probability(jnp.float32(jnp.nan), 3, 10, 5)))
    assert float(log_light_probability(jnp.float32(0.0), 3, 10, 5)) == -np.inf
    with pytest.raises(ValueError, match="index.projections must be"):
        hybrid_attention(q, k, v, dataclasses.replace(index, projections=index.projections[:, :-1]), cfg)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_oracle_sampling_gives_nan_for_a_head_whose_keys_hold_a_non_finite_one(bad):
    """Its weights are undefined: out NaN with the LSE (a review found a finite mean of draws from the
    other keys beside lse NaN); the heads of the other KV head stay finite."""
    from magicpig_jax.attention import oracle_sampling_attention

    q, k, v = _qkv(300, bad)
    out, lse, _ = oracle_sampling_attention(jax.random.key(0), q, k, v, 64)
    bad_heads = np.isnan(np.asarray(lse[0]))
    assert bad_heads.any() and not bad_heads.all()
    assert np.isnan(np.asarray(out[0])[bad_heads]).all() and np.isfinite(np.asarray(out[0])[~bad_heads]).all()


def test_merge_never_reads_the_out_of_an_empty_part():
    """An empty part (lse = -inf) contributes nothing whatever its out holds: a hand-built part with
    out NaN and lse -inf gave NaN (0 * NaN)."""
    from magicpig_jax.attention import merge_attention

    o = jnp.full((2, 3), 2.0)
    bad = jnp.full((2, 3), jnp.nan)
    for args in ((o, jnp.array([0.5, 1.0]), bad, jnp.array([-jnp.inf, -jnp.inf])),
                 (bad, jnp.array([-jnp.inf, -jnp.inf]), o, jnp.array([0.5, 1.0]))):
        out, lse = merge_attention(*args)
        np.testing.assert_array_equal(np.asarray(out), 2.0)
        np.testing.assert_array_equal(np.asarray(lse), [0.5, 1.0])
    # two parts at -inf: empty (out 0) stays empty; out NaN is keys whose logits are all -inf (as the
    # attention functions return them), 0/0 over the union too
    zero, minus_inf = jnp.zeros((2, 3)), jnp.array([-jnp.inf] * 2)
    out, lse = merge_attention(zero, minus_inf, zero, minus_inf)
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    assert (np.asarray(lse) == -np.inf).all()
    out, lse = merge_attention(bad, minus_inf, zero, minus_inf)
    assert np.isnan(np.asarray(out)).all() and (np.asarray(lse) == -np.inf).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_non_finite_query_gives_nan_even_with_an_empty_static_set(bad):
    """With no sinks and no local window, a non-finite query sampled nothing and came back as an
    empty row (out 0, lse -inf, finite-looking), where dense attention gives NaN; now MagicPIG (pure
    and host), the hybrid and dense all give NaN for that head, and the other heads are unchanged."""
    from magicpig_jax import lsh
    from magicpig_jax.attention import (
        HybridConfig,
        build_lsh_index,
        dense_attention,
        hybrid_attention,
        magicpig_attention,
    )

    r = jax.random.split(jax.random.key(3), 3)
    k, v = jax.random.normal(r[0], (1, 2, 200, 16)), jax.random.normal(r[1], (1, 2, 200, 16))
    q = jax.random.normal(r[2], (1, 4, 16))
    q_bad = q.at[0, 1, 5].set(bad)  # query head 1 (KV head 0)
    cfg = MagicPIGConfig(K=3, L=10, num_sink=0, num_local=0)
    proj = lsh.simhash_projections(jax.random.key(1), 16, 3, 10)
    index = build_lsh_index(k, proj, cfg)
    hcfg = HybridConfig(K=3, L=10, num_sink=0, num_local=0, heavy=5)
    hidx = host.host_build_index(k, proj, cfg)
    results = {
        "dense": dense_attention(q_bad, k, v)[:2],
        "magicpig": magicpig_attention(q_bad, k, v, index, cfg)[:2],
        "hybrid": hybrid_attention(q_bad, k, v, index, hcfg)[:2],
        **{f"host-{impl}": host.host_magicpig_attention(q_bad, k, v, hidx, cfg, impl=impl)[:2] for impl in IMPLS},
    }
    clean = {"magicpig": magicpig_attention(q, k, v, index, cfg)[:2],
             "hybrid": hybrid_attention(q, k, v, index, hcfg)[:2],
             "host": host.host_magicpig_attention(q, k, v, hidx, cfg)[:2]}
    for name, (out, lse) in results.items():
        out, lse = np.asarray(out), np.asarray(lse)
        assert np.isnan(out[0, 1]).all() and np.isnan(lse[0, 1]), name
        assert np.isfinite(lse[0, [0, 2, 3]]).all(), name
        if name in ("magicpig", "hybrid"):  # the same program: equal up to XLA's code generation
            np.testing.assert_allclose(out[0, [0, 2, 3]], np.asarray(clean[name][0])[0, [0, 2, 3]], rtol=0, atol=1e-6)
        if name.startswith("host-"):
            np.testing.assert_allclose(out[0, [0, 2, 3]], np.asarray(clean["host"][0])[0, [0, 2, 3]], atol=1e-6)
    # One head over 4,096 keys and two threads: the op splits the head into pieces (fewer heads
    # than threads), merged after; the merged head is NaN too.
    k1, v1 = jax.random.normal(r[0], (1, 1, 4096, 16)), jax.random.normal(r[1], (1, 1, 4096, 16))
    hidx1 = host.host_build_index(k1, proj, cfg)
    out, lse = host.host_magicpig_attention(q_bad[:, 1:2], k1, v1, hidx1, cfg, max_threads=2)[:2]
    assert np.isnan(np.asarray(out)).all() and np.isnan(np.asarray(lse)).all()
    out, lse = host.host_magicpig_attention(q[:, 1:2], k1, v1, hidx1, cfg, max_threads=2)[:2]
    assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all()


@pytest.mark.parametrize("bad", ["nan", "inf", "zero column"])
def test_broken_projections_are_refused_or_give_nan(bad):
    """A NaN, infinite or all-zero hyperplane gives every key and query bit 0 in its tables: the
    sample and its weights no longer match (a finite, wrong result before). Concrete projections
    are refused by both index builders; traced ones make the index's mean NaN, so both paths give
    NaN for every head."""
    from magicpig_jax import lsh
    from magicpig_jax.attention import build_lsh_index, magicpig_attention
    from magicpig_jax.host.build import host_build_index

    q, k, v = _qkv(0, 0.0)  # position 0 is a sink: every key finite
    cfg = MagicPIGConfig(K=4, L=16, num_sink=4, num_local=8)
    good = lsh.simhash_projections(jax.random.key(1), 16, cfg.K, cfg.L)
    broken = {"nan": good.at[2, 5].set(jnp.nan), "inf": good.at[2, 5].set(jnp.inf),
              "zero column": good.at[:, 5].set(0.0)}[bad]
    for build in (build_lsh_index, host_build_index):
        with pytest.raises(ValueError, match="projections must be finite SimHash hyperplanes, none of them 0"):
            build(k, broken, cfg)

    def jax_path(p):
        return magicpig_attention(q, k, v, build_lsh_index(k, p, cfg), cfg)[0]

    def host_path(p):
        return host.host_magicpig_attention(q, k, v, host_build_index(k, p, cfg), cfg)[0]

    for path in (jax_path, host_path):
        assert np.isfinite(np.asarray(jax.jit(path)(good))).all()
        assert np.isnan(np.asarray(jax.jit(path)(broken))).all()
