"""magicpig_jax.host.attention: the sampled-attention op at the edges the fuzz does not reach.

* the per-thread hit counts never carry over from one query head to another (they did once: a
  16-bit stamp epoch that wrapped without a clear);
* the paper's setting (K=10, L=150, D=64 and 128) over a full 65,535-position chunk and past it
  (N = 65,535, 70,000 and 131,071), against the pure-JAX reference;
* the op reads only the K/V rows it selects (NaN elsewhere leaves the result unchanged).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magicpig_jax import host, lsh
from magicpig_jax.attention import MagicPIGConfig, build_lsh_index, magicpig_attention
from magicpig_jax.attention.magicpig import sampled_mask_and_log_u
from magicpig_jax.host.index import chunk_geometry
from tests._np_reference import softmax_over

IMPLS = ["scalar", "avx2"] if host.has_avx2() else ["scalar"]

EPOCHS = 1 << 14  # heads visited by one thread: the former 14-bit stamp epoch wrapped within them


@pytest.mark.parametrize("impl", IMPLS)
def test_hits_never_carry_over_between_heads_samples_nothing(impl):
    # One KV head, Hq = 2^14 query heads, one worker thread (max_threads=1): the op visits the
    # heads in order, one chunk each, with the same per-thread hit bitsets (cleared per visit;
    # the former 16-bit stamps ran head 0 and head 2^14 - 1 under the same epoch value).
    # Position 1 is the only hashed key (sinks [0, 1), local
    # [2, 3)); centered it is the zero vector, so its code is 0 in both tables. Head 0 collides
    # with it in table 0 only, head 2^14 - 1 in table 1 only, every other head in neither. No
    # head reaches 2 tables: nothing may be sampled. Hits kept from head 0 would let the last
    # head count 2 hits.
    K, L, D = 2, 2, 4
    Hq = EPOCHS
    cfg = MagicPIGConfig(K=K, L=L, num_sink=1, num_local=1)
    proj = jnp.eye(D, dtype=jnp.float32)  # bit j of table l is coordinate 2l + j > 0
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((1, 1, 3, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 1, 3, D)), jnp.float32)
    q = np.ones((1, Hq, D), np.float32)  # codes (3, 3): no collision
    q[0, 0] = [-1, -1, 1, 1]  # codes (0, 3): table 0 only
    q[0, -1] = [1, 1, -1, -1]  # codes (3, 0): table 1 only
    q = jnp.asarray(q * rng.uniform(0.5, 2.0, (1, Hq, 1)), jnp.float32)
    lengths = jnp.asarray([3], jnp.int32)
    hidx = host.host_build_index(k, proj, cfg, lengths)
    np.testing.assert_array_equal(np.asarray(hidx.bounds), [[1, 2, 2]])
    for _ in range(2):  # a second call reuses the thread's bitsets
        out, lse, ns, mask = host.host_magicpig_attention(q, k, v, hidx, cfg, lengths, impl=impl,
                                                          max_threads=1, return_mask=True)
        assert int(np.asarray(ns).sum()) == 0
        assert not np.asarray(mask).any()
        # Expected: exact attention over the two static keys 0 and 2 (float64).
        q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
        for h in (0, 1, Hq // 2, Hq - 1):
            logits = k64[0, 0] @ q64[0, h] / 2.0
            o_ref, l_ref = softmax_over(logits, np.array([True, False, True]), v64[0, 0])
            np.testing.assert_allclose(np.asarray(out[0, h]), o_ref, rtol=0, atol=1e-5)
            assert abs(float(lse[0, h]) - l_ref) < 1e-5
    # The pure-JAX reference agrees (same codes, nothing sampled).
    ref = build_lsh_index(k, proj, cfg, lengths)
    out_r, lse_r, ns_r = magicpig_attention(q, k, v, ref, cfg, lengths)
    assert int(np.asarray(ns_r).sum()) == 0
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_r), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_r), rtol=0, atol=1e-5)


_ref_build = jax.jit(build_lsh_index, static_argnames="config")
_host_build = jax.jit(host.host_build_index, static_argnames=("config", "chunk_size"))


@jax.jit(static_argnames="cfg")
def _reference(q, k, v, index, lengths, cfg):
    out, lse, ns = magicpig_attention(q, k, v, index, cfg, lengths)
    sampled, _, _ = sampled_mask_and_log_u(q, k, index, cfg, lengths)
    return out, lse, ns, sampled.reshape(q.shape[0], q.shape[1], k.shape[2])


@pytest.mark.parametrize(
    "N,D,chunk_size,chunks",
    [
        (65_535, 128, None, (1, 65_535)),  # one full chunk: its count 65535 is the largest uint16 offset
        (70_000, 64, None, (2, 35_000)),  # past one chunk: two balanced chunks
        (131_071, 64, 65_535, (3, 65_535)),  # two full chunks and one position in a third
    ],
)
def test_paper_setting_over_full_chunks_matches_reference(N, D, chunk_size, chunks):
    # K = 10, L = 150 (the paper's setting), every row at its full length (= the capacity), no
    # local window: the last position (the last id of a full chunk, or alone in a third chunk) is
    # hashed, and its key points along query head 0 from the mean, so head 0 samples it.
    cfg = MagicPIGConfig(K=10, L=150, num_sink=4, num_local=0)
    B, Hkv, G = 1, 1, 3
    rng = np.random.default_rng(N)
    q = rng.standard_normal((B, Hkv * G, D), np.float32)
    k = rng.standard_normal((B, Hkv, N, D), np.float32) + rng.standard_normal((1, 1, 1, D), np.float32)
    k[0, 0, -1] = k[0, 0, 4:-1].mean(0) + 20 * q[0, 0]
    q, k = jnp.asarray(q), jnp.asarray(k)
    v = jnp.asarray(rng.standard_normal((B, Hkv, N, D), np.float32))
    proj = jnp.asarray(rng.standard_normal((D, cfg.K * cfg.L), np.float32))
    lengths = jnp.full((B,), N, jnp.int32)
    hidx = _host_build(k, proj, cfg, lengths, chunk_size=chunk_size)
    assert hidx.ids.shape[2] == chunks[0] and hidx.ids.shape[4] == chunks[1]
    assert chunk_geometry(N, chunk_size) == chunks
    ref = _ref_build(k, proj, cfg, lengths)
    out_r, lse_r, ns_r, mask_r = (np.asarray(x) for x in _reference(q, k, v, ref, lengths, cfg=cfg))
    # Keys are sampled in every chunk, the last positions included (the reference says where).
    pos = np.flatnonzero(mask_r.any(axis=(0, 1)))
    assert pos.size > 0.002 * N and mask_r[0, 0, N - 1]
    for c in range(chunks[0]):
        assert np.any((pos >= c * chunks[1]) & (pos < (c + 1) * chunks[1])), c
    for impl in IMPLS:
        out, lse, ns, mask = host.host_magicpig_attention(q, k, v, hidx, cfg, lengths, impl=impl, return_mask=True)
        np.testing.assert_array_equal(np.asarray(ns), ns_r)
        np.testing.assert_array_equal(np.asarray(mask), mask_r)
        np.testing.assert_allclose(np.asarray(lse), lse_r, rtol=0, atol=1e-5 * max(1.0, np.abs(lse_r).max()))
        np.testing.assert_allclose(np.asarray(out), out_r, rtol=0, atol=1e-5 * max(1.0, np.abs(out_r).max()))


def test_one_bucket_holding_a_full_chunk():
    # Every key of a full 65,535-position chunk in one bucket of each table: the bucket starts
    # are uint16, and this chunk's are [0, 65535, 65535, 65535, 65535] (the largest count a
    # chunk can have). Identical keys center to the zero vector (code 0 in both tables with the
    # identity projections), the query's codes are 0 too, so every key is sampled, each with the
    # same u; the estimate is then the u-weighted mean of V, checked in float64.
    K, L, D, N = 2, 2, 4, 65_535
    cfg = MagicPIGConfig(K=K, L=L, num_sink=0, num_local=0)
    rng = np.random.default_rng(1)
    # values whose float32 sums stay exact, so the mean is the key itself and it centers to zero
    k = jnp.asarray(np.broadcast_to([1.0, -2.0, 0.5, 3.0], (1, 1, N, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((1, 1, N, D)), jnp.float32)
    q = jnp.asarray([[[-1.0, -2.0, -0.5, -1.5]]], jnp.float32)
    lengths = jnp.asarray([N], jnp.int32)
    hidx = host.host_build_index(k, jnp.eye(D, dtype=jnp.float32), cfg, lengths)
    assert hidx.offsets.dtype == jnp.uint16 and hidx.ids.shape[2:] == (1, L, N)
    np.testing.assert_array_equal(np.asarray(hidx.offsets[0, 0, 0]), [[0, N, N, N, N]] * L)
    for impl in IMPLS:
        out, lse, ns = host.host_magicpig_attention(q, k, v, hidx, cfg, lengths, impl=impl)
        assert int(ns[0, 0]) == N
        # equal scores and equal u: the weights cancel, out is the mean of V (float64)
        np.testing.assert_allclose(np.asarray(out[0, 0]), np.asarray(v, np.float64)[0, 0].mean(0), rtol=0, atol=1e-5)
        score = float(np.asarray(k, np.float64)[0, 0, 0] @ np.asarray(q, np.float64)[0, 0]) / np.sqrt(D)
        log_u = 2 * np.log(0.5**K)  # zero-vector key: cosine 0, p = 1/2 per bit, collide in both tables
        assert abs(float(lse[0, 0]) - (score + np.log(N) - log_u)) < 1e-4


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_op_reads_only_the_rows_it_selects(impl, dtype):
    # NaN in every K and V row the op does not select (keys no head samples, sinks, the tail left
    # to the caller's window, padding past each row's length): its result is bit for bit the one of
    # the clean cache (which the tests above compare with the reference).
    B, Hq, Hkv, N, D, W = 2, 4, 2, 200, 16, 6
    cfg = MagicPIGConfig(K=3, L=6, num_sink=4, num_local=10)
    rng = np.random.default_rng(5)
    q = jnp.asarray(rng.standard_normal((B, Hq, D), np.float32))
    k = jnp.asarray((rng.standard_normal((B, Hkv, N, D)) + 0.5).astype(np.float32)).astype(dtype)
    v = jnp.asarray(rng.standard_normal((B, Hkv, N, D)).astype(np.float32)).astype(dtype)
    proj = jnp.asarray(rng.standard_normal((D, cfg.K * cfg.L), np.float32))
    lengths = jnp.asarray([170, 121], jnp.int32)
    hidx = host.host_build_index(k, proj, cfg, lengths - 20)  # 20 unhashed keys past the index
    qc = lsh.simhash_codes(q, proj, cfg.K, cfg.L)
    out, lse, ns, mask = host.host_sampled_attention(q, qc, k, v, hidx, lengths, window=W, impl=impl,
                                                     return_mask=True)
    mask = np.asarray(mask)
    # The rows the op may read: sampled by some head of the KV head, or exact in [end, len - W).
    used = np.zeros((B, Hkv, N), bool)
    end = np.asarray(hidx.end)
    for b in range(B):
        used[b] = mask[b].reshape(Hkv, Hq // Hkv, N).any(1)
        used[b, :, end[b] : int(lengths[b]) - W] = True
    assert used.sum() < 0.6 * B * Hkv * N and int(np.asarray(ns).sum()) > 0
    nan = jnp.asarray(np.where(used[..., None], 0.0, np.nan), jnp.float32).astype(dtype)
    out2, lse2, ns2, mask2 = host.host_sampled_attention(q, qc, k + nan, v + nan, hidx, lengths, window=W,
                                                         impl=impl, return_mask=True)
    np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
    np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))
    np.testing.assert_array_equal(np.asarray(ns2), np.asarray(ns))
    np.testing.assert_array_equal(np.asarray(mask2), mask)
    assert np.isfinite(np.asarray(out2)).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("max_threads", [1, 0])  # 0: the pool, whose two threads split a lone head
def test_a_non_finite_key_in_the_hashed_range_gives_nan_not_a_silent_sample(impl, bad, max_threads):
    """One NaN or infinite key in KV head 0's hashed range makes its mean non-finite and every
    centered code 0; head 0's query heads then get NaN from both the op and the pure-JAX
    reference (the op used to return the static part alone, finite), head 1 its usual result."""
    r = jax.random.split(jax.random.key(0), 3)
    k = jax.random.normal(r[0], (1, 2, 3000, 16)).at[0, 0, 1000, 3].set(bad)
    v = jax.random.normal(r[1], (1, 2, 3000, 16))
    q = jax.random.normal(r[2], (1, 4, 16))
    cfg = MagicPIGConfig(K=4, L=20, num_sink=4, num_local=16)
    proj = lsh.simhash_projections(jax.random.key(1), 16, 4, 20)
    ref_out, ref_lse, _ = magicpig_attention(q, k, v, build_lsh_index(k, proj, cfg), cfg)
    out, lse, _ = host.host_magicpig_attention(q, k, v, host.host_build_index(k, proj, cfg), cfg, impl=impl,
                                               max_threads=max_threads)
    for o, lo in ((ref_out, ref_lse), (out, lse)):
        assert np.isnan(np.asarray(o[0, :2])).all() and np.isnan(np.asarray(lo[0, :2])).all()
        assert np.isfinite(np.asarray(o[0, 2:])).all()
    np.testing.assert_allclose(np.asarray(out[0, 2:]), np.asarray(ref_out[0, 2:]), atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("pos", [1, 2995])  # a sink, the local window
@pytest.mark.parametrize("static_window", [0, None])  # 0: the op attends the static keys (the decoder's way)
@pytest.mark.parametrize("max_threads", [1, 0])
def test_a_nan_static_key_gives_nan_in_the_op_as_in_the_reference(impl, pos, static_window, max_threads):
    """A NaN key among the exact (static) keys: the op's own softmax over them (static_window=0, as
    the single-device decoder calls it, split heads included) gives NaN out and lse, as the pure-JAX
    reference does; it used to give a finite, empty-looking head."""
    r = jax.random.split(jax.random.key(0), 3)
    k = jax.random.normal(r[0], (1, 2, 3000, 16)).at[0, 0, pos, 3].set(jnp.nan)
    v = jax.random.normal(r[1], (1, 2, 3000, 16))
    q = jax.random.normal(r[2], (1, 4, 16))
    cfg = MagicPIGConfig(K=4, L=20, num_sink=4, num_local=16)
    proj = lsh.simhash_projections(jax.random.key(1), 16, 4, 20)
    kw = {} if static_window is None else {"static_window": static_window}
    out, lse, _ = host.host_magicpig_attention(q, k, v, host.host_build_index(k, proj, cfg), cfg, impl=impl,
                                               max_threads=max_threads, **kw)
    ref_out, ref_lse, _ = magicpig_attention(q, k, v, build_lsh_index(k, proj, cfg), cfg)
    for o, lo in ((out, lse), (ref_out, ref_lse)):
        assert np.isnan(np.asarray(o[0, :2])).all() and np.isnan(np.asarray(lo[0, :2])).all()
    np.testing.assert_allclose(np.asarray(out[0, 2:]), np.asarray(ref_out[0, 2:]), atol=1e-5)


def test_a_config_with_another_static_set_than_the_index_is_refused():
    # An index built with 4 sinks and a window of 60 over 64 keys hashes nothing: every key is in
    # its static set, and attention must equal dense attention (float64). A config with fewer sinks
    # had attended to [0, num_sink) and [index.end, N) only, dropping sinks 2 and 3 without a word
    # (the query looks at key 2); the host op, the offload path and the sharded op now refuse any
    # config whose num_sink or num_local differs from the index's, as the pure-JAX function does.
    from magicpig_jax import distributed, offload

    rng = np.random.default_rng(0)
    B, Hkv, N, D = 1, 1, 64, 8
    k = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), jnp.float32)
    q = 3 * k[:, :, 2]
    built = MagicPIGConfig(K=4, L=8, num_sink=4, num_local=60)
    proj = lsh.simhash_projections(jax.random.key(0), D, 4, 8)
    hidx = host.host_build_index(k, proj, built)
    assert (hidx.num_sink, hidx.num_local) == (4, 60)
    out, lse, _ = host.host_magicpig_attention(q, k, v, hidx, built)
    k64, v64 = np.asarray(k, np.float64)[0, 0], np.asarray(v, np.float64)[0, 0]
    o_ref, lse_ref = softmax_over(k64 @ np.asarray(q, np.float64)[0, 0] / np.sqrt(D), np.ones(N, bool), v64)
    np.testing.assert_allclose(np.asarray(out)[0, 0], o_ref, atol=2e-6)
    np.testing.assert_allclose(float(lse[0, 0]), lse_ref, atol=2e-6)

    accel, cpu = offload.default_devices()
    mesh = distributed.make_mesh(1, devices=jax.devices()[:1])
    sharded = distributed.sharded_build_index(mesh, k, proj, built)
    for name, value in (("num_sink", 0), ("num_sink", 2), ("num_sink", 5), ("num_local", 59)):
        other = MagicPIGConfig(K=4, L=8, **{**dict(num_sink=4, num_local=60), name: value})
        msg = f"the index was built with {name}={getattr(built, name)} but config has {name}={value}: "
        with pytest.raises(ValueError, match="^" + msg):
            host.host_magicpig_attention(q, k, v, hidx, other)
        with pytest.raises(ValueError, match="^" + msg):
            offload.prepare_offload(k, v, hidx, other, None, accel_device=accel, host_device=cpu)
        with pytest.raises(ValueError, match="^" + msg):
            distributed.sharded_magicpig_attention(mesh, q, k, v, sharded, other)


def test_the_op_alone_checks_lengths_as_the_wrapper_does():
    """``host_sampled_attention`` (public: the FFI op alone) takes int ``[B]`` lengths in ``[0, N]``,
    as :func:`host_magicpig_attention` does: concrete ones outside raise (it clamped them silently)."""
    K, L, D, N = 2, 4, 4, 16
    cfg = MagicPIGConfig(K=K, L=L, num_sink=1, num_local=1)
    rng = np.random.default_rng(3)
    k, v = (jnp.asarray(rng.standard_normal((1, 1, N, D)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((1, 2, D)), jnp.float32)
    hidx = host.host_build_index(k, jnp.asarray(rng.standard_normal((D, K * L)), jnp.float32), cfg)
    codes = host.host_simhash_codes(q, hidx.projections, K, L)
    for bad in ([N + 1], [-5], [2**31 - 1]):
        with pytest.raises(ValueError, match=rf"^lengths must be in \[0, {N}\] \(the KV capacity\)"):
            host.host_sampled_attention(q, codes, k, v, hidx, jnp.asarray(bad, jnp.int32))
    with pytest.raises(TypeError, match="lengths"):
        host.host_sampled_attention(q, codes, k, v, hidx, jnp.asarray([3.0]))
    out, lse, ns = host.host_sampled_attention(q, codes, k, v, hidx, jnp.asarray([N], jnp.int32))
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_an_index_starting_past_the_context_attends_the_written_keys_exactly(impl):
    # A decoder's index after a prompt shorter than num_sink: its range starts at num_sink
    # (models.backends.spec.decode_range_lengths) while the context holds fewer keys. The op and
    # the static part read only the written positions [0, len): dense attention over them, and
    # garbage (NaN) in the unwritten slots changes nothing.
    B, Hq, Hkv, N, D = 2, 4, 2, 40, 16
    cfg = MagicPIGConfig(K=3, L=6, num_sink=4, num_local=8)
    rng = np.random.default_rng(7)
    q = jnp.asarray(rng.standard_normal((B, Hq, D), np.float32))
    k = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    lengths = np.array([2, 3], np.int32)
    for b, n in enumerate(lengths):
        k[b, :, n:], v[b, :, n:] = np.nan, np.nan
    proj = jnp.asarray(rng.standard_normal((D, cfg.K * cfg.L), np.float32))
    hidx = host.host_build_index(jnp.asarray(np.nan_to_num(k)), proj, cfg, jnp.full((B,), cfg.num_sink, jnp.int32))
    assert np.asarray(hidx.start).tolist() == [4, 4] and np.asarray(hidx.end).tolist() == [4, 4]
    out, lse, ns = host.host_magicpig_attention(q, jnp.asarray(k), jnp.asarray(v), hidx, cfg, jnp.asarray(lengths),
                                                impl=impl)
    assert np.asarray(ns).sum() == 0
    G = Hq // Hkv
    for b, n in enumerate(lengths):
        for h in range(Hq):
            kk, vv = k[b, h // G, :n].astype(np.float64), v[b, h // G, :n].astype(np.float64)
            s = kk @ np.asarray(q[b, h], np.float64) / np.sqrt(D)
            w = np.exp(s - s.max())
            np.testing.assert_allclose(np.asarray(out[b, h]), w @ vv / w.sum(), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(float(lse[b, h]), s.max() + np.log(w.sum()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("k_scale,q_scale", [(1e-20, 1.0), (1.0, 1e-20), (1.0, 1e-37), (1e-20, 1e-20),
                                             (1e20, 1e-20), (1e30, 1e-30)])
def test_tiny_or_huge_queries_and_keys_weigh_samples_as_the_reference(impl, k_scale, q_scale):
    """The op's cosine (for u) squared the query and the centered key in float32: below a norm of about
    1e-19 the squares underflowed, above about 1.8e19 they overflowed, and every sampled key was weighed
    as if orthogonal (u of p = 1/2), while the codes and the pure-JAX reference use the scaled vectors
    (outputs 0.1-0.2 apart). The query is now scaled by a power of two, and a centered key's cosine is
    taken in float64 when its float32 squared norm is outside [1e-30, 1e30]."""
    rng = np.random.default_rng(0)
    B, Hkv, Hq, N, D, K, L = 1, 1, 2, 256, 32, 4, 20
    cfg = MagicPIGConfig(K=K, L=L, num_sink=4, num_local=16)
    k = jnp.asarray(rng.normal(size=(B, Hkv, N, D)).astype(np.float32) * np.float32(k_scale))
    q = jnp.asarray(rng.normal(size=(B, Hq, D)).astype(np.float32) * np.float32(q_scale))
    v = jnp.asarray(rng.normal(size=(B, Hkv, N, D)).astype(np.float32))
    proj = lsh.simhash_projections(jax.random.key(1), D, K, L)
    out, lse, ns = magicpig_attention(q, k, v, build_lsh_index(k, proj, cfg), cfg)
    got_out, got_lse, got_ns = host.host_magicpig_attention(q, k, v, host.host_build_index(k, proj, cfg), cfg,
                                                            impl=impl)
    np.testing.assert_array_equal(np.asarray(got_ns), np.asarray(ns))
    assert int(np.asarray(ns).min()) > 0
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(out), atol=2e-5)
    np.testing.assert_allclose(np.asarray(got_lse), np.asarray(lse), atol=2e-5)
