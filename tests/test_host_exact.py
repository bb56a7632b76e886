"""The exact host attention of the dense layers (magicpig_jax.host.exact) against float64 NumPy,
its edge cases and errors, and its use by the host MagicPIG decoder."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magicpig_jax import host
from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.host import MAX_GROUP, host_exact_attention
from magicpig_jax.models.backends import DecodeSpec
from magicpig_jax.models.cache import KVCache
from magicpig_jax.models.config import LlamaConfig
from magicpig_jax.models.decoding import build_indices, decode_step
from magicpig_jax.models.llama import Llama

IMPLS = ["scalar", "avx2"] if host.has_avx2() else ["scalar"]
_exact = jax.jit(host_exact_attention, static_argnames=("impl", "max_threads", "softcap"))


def reference(q, k, v, lengths, starts=None, softcap=None):
    """float64 softmax attention with GQA over keys starts[b] .. lengths[b] - 1 (starts default 0), each
    logit s soft-capped to ``c tanh(s / c)`` with ``softcap`` c (Gemma 2): (out, lse)."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (q, k, v))
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    out = np.zeros((B, Hq, D))
    lse = np.full((B, Hq), -np.inf)
    for b in range(B):
        n = int(np.clip(lengths[b], 0, k.shape[2]))
        first = 0 if starts is None else int(np.clip(starts[b], 0, n))
        if n == first:
            continue
        for h in range(Hq):
            s = k[b, h // G, first:n] @ q[b, h] / np.sqrt(D)
            s = s if softcap is None else softcap * np.tanh(s / softcap)
            m = s.max()
            e = np.exp(s - m)
            out[b, h] = e @ v[b, h // G, first:n] / e.sum()
            lse[b, h] = m + np.log(e.sum())
    return out, lse


@st.composite
def problems(draw):
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 3))
    G = draw(st.integers(1, 4))
    N = draw(st.integers(0, 300))
    D = draw(st.sampled_from([1, 7, 8, 20, 64, 72]))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    lengths = draw(st.lists(st.integers(-3, N + 3), min_size=B, max_size=B))
    # a sliding-window start per row, or none (every key from 0); past lengths is an empty row
    starts = draw(st.none() | st.lists(st.integers(-3, N + 3), min_size=B, max_size=B))
    seed = draw(st.integers(0, 2**31 - 1))
    softcap = draw(st.none() | st.sampled_from([0.05, 1.5, 50.0]))  # Gemma 2's attention logit soft-capping
    return B, Hkv * G, Hkv, N, D, dtype, lengths, starts, seed, softcap


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=min(40, settings.default.max_examples))  # fewer than the default 100 (CI time)
@given(problems())
def test_matches_float64_reference(impl, p):
    B, Hq, Hkv, N, D, dtype, lengths, starts, seed, softcap = p
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, Hq, D)) * 2, jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), dtype)
    v = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), dtype)
    first = None if starts is None else jnp.asarray(starts, jnp.int32)
    out, lse = _exact(q, k, v, jnp.asarray(lengths, jnp.int32), first, impl=impl, softcap=softcap)
    ref_out, ref_lse = reference(q, k, v, lengths, starts, softcap)
    assert out.dtype == jnp.float32 and lse.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(ref_lse))
    finite = np.isfinite(ref_lse)
    np.testing.assert_allclose(np.asarray(lse)[finite], ref_lse[finite], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_long_rows_cross_work_items(impl):
    """Rows longer than one work item (2048 keys) and blocks (128 keys) merge exactly."""
    rng = np.random.default_rng(3)
    B, Hq, Hkv, N, D = 2, 9, 3, 5000, 64
    q = jnp.asarray(rng.standard_normal((B, Hq, D)) * 3, jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), jnp.float32)
    lengths = [4999, 2049]
    out, lse = _exact(q, k, v, jnp.asarray(lengths, jnp.int32), impl=impl)
    ref_out, ref_lse = reference(q, k, v, lengths)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-5, rtol=1e-5)
    # sliding windows whose starts are not on a span or block boundary
    starts = [4999 - 4096, 1]
    out, lse = _exact(q, k, v, jnp.asarray(lengths, jnp.int32), jnp.asarray(starts, jnp.int32), impl=impl)
    ref_out, ref_lse = reference(q, k, v, lengths, starts)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, atol=2e-5, rtol=1e-5)


def test_equals_dense_attention_and_one_thread():
    from magicpig_jax.attention import dense_attention

    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((1, 6, 32)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, 2, 3000, 32)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, 2, 3000, 32)), jnp.bfloat16)
    lengths = jnp.asarray([2900], jnp.int32)
    out, lse = host_exact_attention(q, k, v, lengths)
    ref_out, ref_lse = dense_attention(q, k, v, lengths)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=1e-5)
    starts = jnp.asarray([777], jnp.int32)  # a sliding window: the C++ op against the pure-JAX one
    out_w, lse_w = host_exact_attention(q, k, v, lengths, starts)
    ref_w, ref_lse_w = dense_attention(q, k, v, lengths, starts)
    np.testing.assert_allclose(np.asarray(out_w), np.asarray(ref_w), atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse_w), np.asarray(ref_lse_w), atol=1e-5)
    assert not np.allclose(np.asarray(out_w), np.asarray(out), atol=1e-3)
    out1, lse1 = host_exact_attention(q, k, v, lengths, max_threads=1)
    np.testing.assert_allclose(np.asarray(out1), np.asarray(out), atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("max_threads", [1, 0])  # 0: the pool, whose threads split the 3,000 keys into spans
def test_non_finite_logits_give_nan_not_an_empty_row(impl, max_threads):
    """A NaN or +inf logit (a non-finite q or k) makes its head NaN, as dense attention's output
    is; before, the op reported such a head as empty (out 0, lse -inf), silently. A -inf logit is
    a key that gets no weight, and heads of other KV heads keep their values."""
    rng = np.random.default_rng(5)
    q = np.asarray(rng.standard_normal((1, 6, 16)), np.float32)
    k = np.asarray(rng.standard_normal((1, 3, 3000, 16)), np.float32)
    v = np.asarray(rng.standard_normal((1, 3, 3000, 16)), np.float32)
    q[0, 0, 3] = np.inf
    q[0, 1, 0] = np.nan
    k[0, 1, 2000, 5] = np.inf
    q[0, 2, 5] = 1.0  # head 2 (KV head 1): a +inf logit
    q[0, 3, 5] = -1.0  # head 3: a -inf logit, that key gets no weight
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray([3000], jnp.int32))
    out, lse = (np.asarray(x) for x in _exact(*args, impl=impl, max_threads=max_threads))
    assert np.isnan(out[0, :3]).all() and np.isnan(lse[0, :3]).all()
    keep = np.ones(3000, bool)
    keep[2000] = False
    ref3, _ = _exact(jnp.asarray(q[:, 3:4]), jnp.asarray(k[:, 1:2, keep]), jnp.asarray(v[:, 1:2, keep]),
                     jnp.asarray([2999], jnp.int32), impl=impl)
    np.testing.assert_allclose(out[0, 3], np.asarray(ref3)[0, 0], atol=1e-6)
    # KV head 2 (query heads 4-5) is untouched: its heads equal the op on that head alone
    ref45, _ = _exact(jnp.asarray(q[:, 4:]), jnp.asarray(k[:, 2:]), jnp.asarray(v[:, 2:]), jnp.asarray([3000]),
                      impl=impl)
    np.testing.assert_allclose(out[0, 4:], np.asarray(ref45)[0], atol=1e-6)


def test_bad_input_errors_name_the_parameter():
    q = jnp.zeros((1, 4, 8), jnp.float32)
    k = jnp.zeros((1, 2, 10, 8), jnp.float32)
    with pytest.raises(ValueError, match="impl"):
        host_exact_attention(q, k, k, impl="avx512")
    with pytest.raises(ValueError, match="max_threads"):
        host_exact_attention(q, k, k, max_threads=-1)
    with pytest.raises(TypeError, match="k and v"):
        host_exact_attention(q, k, k.astype(jnp.bfloat16))
    with pytest.raises(TypeError, match="k and v"):
        host_exact_attention(q, k.astype(jnp.float16), k.astype(jnp.float16))
    with pytest.raises(ValueError, match="multiple of Hkv"):
        host_exact_attention(jnp.zeros((1, 3, 8), jnp.float32), k, k)
    with pytest.raises(ValueError, match="lengths"):
        host_exact_attention(q, k, k, jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="starts"):
        host_exact_attention(q, k, k, None, jnp.zeros((2,), jnp.int32))
    with pytest.raises(TypeError, match="starts"):
        host_exact_attention(q, k, k, None, jnp.zeros((1,), jnp.float32))
    with pytest.raises(ValueError, match="G = Hq / Hkv"):
        kk = jnp.zeros((1, 1, 4, 8), jnp.float32)
        host_exact_attention(jnp.zeros((1, MAX_GROUP + 1, 8), jnp.float32), kk, kk)


def test_host_decoder_runs_its_dense_layers_in_the_op():
    """A host MagicPIG decode step lowers its dense layers to the op, and no XLA dense path is left."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=512)
    from flax import nnx

    model = Llama(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    cache = KVCache.zeros(cfg, 1, 256)
    cache = KVCache(k=cache.k, v=cache.v, lengths=jnp.asarray([100], jnp.int32))
    spec = DecodeSpec(backend="magicpig", magicpig=MagicPIGConfig(K=4, L=8), dense_layers=(0,), host=True)
    indices = build_indices(cache, spec, cfg.num_layers)
    hlo = decode_step.lower(graphdef, state, cache, indices, jnp.asarray([1], jnp.int32), jax.random.key(0),
                            jnp.float32(0), jnp.float32(1), spec=spec).as_text()
    assert hlo.count("magicpig_exact_attention") >= 1
    assert "magicpig_host_attention" in hlo


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("Hq,Hkv,N,length", [(1, 1, 3000, 2999), (9, 3, 1280, 1024), (2, 2, 700, 700)])
def test_one_row_split_over_threads(impl, Hq, Hkv, N, length):
    # One row with fewer KV heads than work items for the pool: the keys of a head are split into
    # spans (256 keys and more) whose partial softmaxes are merged; one thread and the whole pool
    # both equal the dense reference, and each other, to float32 tolerance.
    from magicpig_jax.attention import dense_attention

    rng = np.random.default_rng(11)
    q = jnp.asarray(rng.standard_normal((1, Hq, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((1, Hkv, N, 64)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, Hkv, N, 64)), jnp.float32)
    lengths = jnp.asarray([length], jnp.int32)
    ref_out, ref_lse = dense_attention(q, k, v, lengths)
    got = {t: _exact(q, k, v, lengths, impl=impl, max_threads=t) for t in (1, 0)}
    for out, lse in got.values():
        np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), atol=2e-6)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), atol=2e-6, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1][0]), np.asarray(got[0][0]), atol=1e-6)
    np.testing.assert_allclose(np.asarray(got[1][1]), np.asarray(got[0][1]), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_head_whose_logits_are_all_minus_inf_is_nan_not_empty(impl):
    """A -inf in q against keys positive in that coordinate makes every logit -inf: the exact op,
    dense attention and TopK (host and pure JAX) reported out 0 and lse -inf, an empty-looking head,
    where a softmax gives NaN. One -inf logit among finite ones still weighs 0."""
    from magicpig_jax.attention import dense_attention, topk_attention
    from magicpig_jax.host import host_topk_attention

    rng = np.random.default_rng(0)
    k = np.abs(rng.standard_normal((1, 2, 300, 8))).astype(np.float32) + 0.1
    v = rng.standard_normal((1, 2, 300, 8)).astype(np.float32)
    q = np.ones((1, 2, 8), np.float32)
    q[0, 0, 0] = -np.inf  # head 0 (KV head 0): every logit -inf
    args = (jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    results = {"exact": host_exact_attention(*args, impl=impl), "dense": dense_attention(*args),
               "host topk": host_topk_attention(*args, 16, impl=impl), "topk": topk_attention(*args, 16)[:2]}
    for name, (out, lse) in results.items():
        out, lse = np.asarray(out), np.asarray(lse)
        assert np.isnan(out[0, 0]).all() and lse[0, 0] == -np.inf, name  # partition function 0: merged, weighs 0
        assert np.isfinite(out[0, 1]).all() and np.isfinite(lse[0, 1]), name
    # an empty range is still empty, not NaN
    out, lse = host_exact_attention(*args, jnp.asarray([0], jnp.int32), impl=impl)
    assert np.asarray(out).tolist() == np.zeros((1, 2, 8)).tolist() and (np.asarray(lse) == -np.inf).all()


def test_max_threads_takes_numpy_integers():
    """np.int64(2) was refused as 'not an int', unlike every other integer option."""
    q = jnp.ones((1, 2, 8), jnp.float32)
    k = jnp.asarray(np.random.default_rng(1).standard_normal((1, 1, 5, 8)), jnp.float32)
    ref = host_exact_attention(q, k, k, max_threads=2)
    for mt in (np.int64(2), np.int32(2)):
        out = host_exact_attention(q, k, k, max_threads=mt)
        np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(ref[0]))
    with pytest.raises(ValueError, match="max_threads"):
        host_exact_attention(q, k, k, max_threads=np.bool_(True))


def test_a_part_whose_logits_are_all_minus_inf_weighs_zero_in_a_merge_and_stays_nan_alone():
    """Such a part was NaN in lse too, so every split-and-merge path turned the head NaN where one
    softmax over the union weighs those keys 0: static attention's window path, the host MagicPIG
    op (sinks all -inf), the pure-JAX TopK decoder (hashed range all -inf). The prefill's block
    attention still gave a head of all -inf logits out 0 (empty-looking)."""
    from magicpig_jax import host, lsh
    from magicpig_jax.attention import MagicPIGConfig, build_lsh_index, dense_attention, magicpig_attention
    from magicpig_jax.attention.baselines import topk_attention
    from magicpig_jax.attention.merge import merge_attention
    from magicpig_jax.attention.static import static_attention
    from magicpig_jax.models.decoding import _causal_block_attention

    def i32(x):
        return jnp.asarray(x, jnp.int32)

    rng = np.random.default_rng(0)
    N, D = 64, 8
    k = rng.standard_normal((1, 1, N, D)).astype(np.float32)
    v = rng.standard_normal((1, 1, N, D)).astype(np.float32)
    q = np.abs(rng.standard_normal((1, 2, D))).astype(np.float32) + 0.1
    k[0, 0, 0:2, 0] = -np.inf  # the two sinks: logit -inf; the rest finite
    k2 = k.copy()
    k2[0, 0, :2, 0] = 1.0
    k2[0, 0, 4:56, 0] = -np.inf
    kp = np.abs(rng.standard_normal((1, 1, N, D))).astype(np.float32) + 0.1  # every key positive
    q, k, k2, v = map(jnp.asarray, (q, k, k2, v))
    L = jnp.asarray([N], jnp.int32)
    ref_out, ref_lse = dense_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), L)
    assert np.isfinite(np.asarray(ref_lse)).all()
    for window in (None, 4):
        out, lse = static_attention(q, k, v, i32([2]), i32([40]), L, num_sink=2, window=window)
        assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(lse)).all(), window
    cfg = MagicPIGConfig(K=2, L=4, num_sink=2, num_local=8)
    proj = lsh.simhash_projections(jax.random.key(1), D, cfg.K, cfg.L)
    _, lse_ref, _ = magicpig_attention(q, k, v, build_lsh_index(k, proj, cfg, L), cfg, L)
    _, lse_host, _ = host.host_magicpig_attention(q, k, v, host.host_build_index(k, proj, cfg, L), cfg, L)
    np.testing.assert_allclose(np.asarray(lse_host), np.asarray(lse_ref), rtol=1e-5)
    # the pure-JAX TopK decoder: range [4, 56) all -inf, merged with the static part = dense
    o_r, l_r = topk_attention(q, k2[:, :, 4:], v[:, :, 4:], 4, i32([52]))
    assert np.isnan(np.asarray(o_r)).all() and (np.asarray(l_r) == -np.inf).all()
    o_s, l_s = static_attention(q, k2, v, i32([4]), i32([56]), L, num_sink=4)
    out, lse = merge_attention(o_r, l_r, o_s, l_s)
    want_out, want_lse = dense_attention(jnp.asarray(q), jnp.asarray(k2), jnp.asarray(v), L)
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), rtol=1e-5)
    # beside an empty part, or alone, such a part stays NaN; two empty parts stay empty
    empty = (jnp.zeros_like(o_r), jnp.full_like(l_r, -jnp.inf))
    assert np.isnan(np.asarray(merge_attention(o_r, l_r, *empty)[0])).all()
    assert np.isnan(np.asarray(merge_attention(*empty, o_r, l_r)[0])).all()
    out, lse = merge_attention(*empty, *empty)
    assert (np.asarray(out) == 0).all() and (np.asarray(lse) == -np.inf).all()
    # the prefill's block attention: every visible logit -inf is NaN, as dense attention gives
    qp = np.ones((1, 1, 2, D), np.float32)
    qp[..., 0] = -np.inf
    out = _causal_block_attention(jnp.asarray(qp), jnp.asarray(kp), jnp.asarray(v), N - 1, 16)
    assert np.isnan(np.asarray(out)).all()
    qp[..., 0] = 1.0
    assert np.isfinite(np.asarray(_causal_block_attention(jnp.asarray(qp), jnp.asarray(kp), jnp.asarray(v),
                                                          N - 1, 16))).all()
