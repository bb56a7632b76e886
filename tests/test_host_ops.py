"""The host-memory FFI op (magicpig_jax.host: index, build, append, sampled attention, log u) against
the pure-JAX reference."""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from magicpig_jax import host, lsh
from magicpig_jax.attention import MagicPIGConfig, build_lsh_index, dense_attention, magicpig_attention
from magicpig_jax.attention.magicpig import sampled_mask_and_log_u
from magicpig_jax.host.log_u import log_u_exact

IMPLS = ["scalar", "avx2"] if host.has_avx2() else ["scalar"]

# Jitted entry points: one compile per shape instead of op-by-op dispatch (keeps the file fast).
_host_attn = jax.jit(
    host.host_magicpig_attention,
    static_argnames=("config", "static_window", "impl", "return_mask", "max_threads", "softcap"),
)
_build = jax.jit(
    host.host_build_index,
    static_argnames=("config", "capacity", "open_capacity", "chunk_size", "max_threads"),
)
_ref_build = jax.jit(build_lsh_index, static_argnames=("config",))
_append = jax.jit(host.host_append)
_key_codes = jax.jit(host.host_key_codes)


@jax.jit(static_argnames=("cfg", "softcap"))
def _reference(q, k, v, ri, lengths, cfg, softcap=None):
    out, lse, ns = magicpig_attention(q, k, v, ri, cfg, lengths, softcap=softcap)
    sampled, _, _ = sampled_mask_and_log_u(q, k, ri, cfg, jnp.clip(lengths, 0, k.shape[2]))
    return out, lse, ns, sampled.reshape(q.shape[0], q.shape[1], k.shape[2])


def make_case(B, Hq, Hkv, N, D, K, L, lengths, num_sink=2, num_local=3, seed=0, dtype=jnp.float32,
              cone=0.5):
    cfg = MagicPIGConfig(K=K, L=L, num_sink=num_sink, num_local=num_local)
    # numpy data: jax.random compiles per shape, which would dominate this file's run time.
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, Hq, D), np.float32))
    k = jnp.asarray(rng.standard_normal((B, Hkv, N, D), np.float32) + np.float32(cone)).astype(dtype)
    v = jnp.asarray(rng.standard_normal((B, Hkv, N, D), np.float32)).astype(dtype)
    proj = jnp.asarray(rng.standard_normal((D, K * L), np.float32))
    return cfg, q, k, v, proj, jnp.asarray(lengths, jnp.int32)


def assert_close(out_h, lse_h, out_r, lse_r, tol=1e-5):
    out_h, lse_h, out_r, lse_r = map(np.asarray, (out_h, lse_h, out_r, lse_r))
    np.testing.assert_array_equal(np.isneginf(lse_h), np.isneginf(lse_r))
    fin = np.isfinite(lse_r)
    np.testing.assert_array_less(np.abs(lse_h[fin] - lse_r[fin]), tol * np.maximum(1.0, np.abs(lse_r[fin])))
    scale = np.maximum(1.0, np.abs(out_r).max(axis=-1, keepdims=True))
    np.testing.assert_array_less(np.abs(out_h - out_r) / scale, tol + np.zeros_like(out_r))
    assert not np.isnan(out_h).any() and not np.isnan(lse_h).any()


def reference(q, k, v, cfg, proj, lengths, ref_index=None, softcap=None):
    ri = _ref_build(k, proj, cfg, lengths) if ref_index is None else ref_index
    out, lse, ns, sampled = _reference(q, k, v, ri, lengths, cfg=cfg, softcap=softcap)
    return out, lse, ns, np.asarray(sampled)


def check_against_reference(q, k, v, cfg, proj, lengths, hidx, ref_index=None, impl="auto", **kw):
    out_h, lse_h, ns_h, mask_h = _host_attn(q, k, v, hidx, cfg, lengths, impl=impl, return_mask=True, **kw)
    out_r, lse_r, ns_r, mask_r = reference(q, k, v, cfg, proj, lengths, ref_index, kw.get("softcap"))
    np.testing.assert_array_equal(np.asarray(ns_h), np.asarray(ns_r))
    np.testing.assert_array_equal(np.asarray(mask_h), mask_r)
    assert_close(out_h, lse_h, out_r, lse_r)
    return ns_h


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    "B,Hq,Hkv,N,D,K,L,lengths",
    [
        (2, 4, 2, 300, 16, 4, 8, [300, 123]),  # GQA, mixed lengths
        (1, 3, 3, 200, 13, 3, 6, [200]),  # D not a multiple of 8
        (3, 2, 1, 90, 24, 2, 4, [0, 5, 90]),  # empty row, all-static row
    ],
)
def test_matches_reference(impl, B, Hq, Hkv, N, D, K, L, lengths):
    cfg, q, k, v, proj, lens = make_case(B, Hq, Hkv, N, D, K, L, lengths)
    hidx = _build(k, proj, cfg, lens, chunk_size=64, open_capacity=7)
    assert hidx.ids.shape[2:] == (-(-N // 64), L, 64)  # chunk_size is honoured: several chunks
    ns = check_against_reference(q, k, v, cfg, proj, lens, hidx, impl=impl)
    assert int(np.asarray(ns).sum()) > 0


def test_static_window_smaller_than_tail():
    # Unhashed keys before the JAX window are handled exactly by the op.
    cfg, q, k, v, proj, lens = make_case(2, 4, 2, 120, 16, 3, 6, [120, 60], num_local=30)
    hidx = _build(k, proj, cfg, lens)
    for w in (0, 5, 30, 500):
        check_against_reference(q, k, v, cfg, proj, lens, hidx, static_window=w)


def test_zero_capacity_and_zero_lengths():
    cfg, q, k, v, proj, lens = make_case(2, 2, 1, 0, 8, 3, 4, [0, 0])
    hidx = _build(k, proj, cfg, lens)
    out, lse, ns = _host_attn(q, k, v, hidx, cfg, lens)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
    assert np.all(np.asarray(ns) == 0)
    cfg, q, k, v, proj, lens = make_case(2, 2, 1, 50, 8, 3, 4, [0, 0])
    hidx = _build(k, proj, cfg, lens)
    out, lse, ns = _host_attn(q, k, v, hidx, cfg, lens)
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_nothing_sampled_equals_static_part():
    # K=16, L=2: two exact 16-bit collisions essentially never happen.
    cfg, q, k, v, proj, lens = make_case(1, 2, 1, 400, 16, 16, 2, [400], cone=0.0)
    hidx = _build(k, proj, cfg, lens)
    ns = check_against_reference(q, k, v, cfg, proj, lens, hidx)
    assert int(np.asarray(ns).sum()) == 0
    out, lse, ns2 = host.host_sampled_attention(
        q, lsh.simhash_codes(q, proj, 16, 2), k, v, hidx, lens, window=400
    )
    assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_all_static_equals_dense():
    cfg, q, k, v, proj, lens = make_case(2, 4, 2, 5, 16, 3, 4, [5, 4])
    hidx = _build(k, proj, cfg, lens)
    out, lse, ns = _host_attn(q, k, v, hidx, cfg, lens)
    out_d, lse_d = dense_attention(q, k, v, lens)
    assert_close(out, lse, out_d, lse_d)
    assert np.all(np.asarray(ns) == 0)


def test_zero_query_and_key_equal_to_mean():
    cfg, q, k, v, proj, lens = make_case(1, 2, 1, 60, 8, 2, 6, [60])
    q = q.at[0, 0].set(0.0)
    k = k.at[0, 0, 2:57].set(k[0, 0, 10])  # every hashed key equals the mean key
    hidx = _build(k, proj, cfg, lens)
    check_against_reference(q, k, v, cfg, proj, lens, hidx)


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16_close_to_float32(impl):
    cfg, q, k, v, proj, lens = make_case(2, 4, 2, 256, 32, 4, 10, [256, 200])
    hidx = _build(k, proj, cfg, lens)
    out32, lse32, ns32 = _host_attn(q, k, v, hidx, cfg, lens, impl=impl)
    kb, vb = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    out16, lse16, ns16 = _host_attn(q, kb, vb, hidx, cfg, lens, impl=impl)
    np.testing.assert_allclose(np.asarray(out16), np.asarray(out32), atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.asarray(lse16), np.asarray(lse32), atol=1e-2, rtol=1e-2)
    # Same sampled set (the index and query codes do not depend on the storage dtype).
    np.testing.assert_array_equal(np.asarray(ns16), np.asarray(ns32))
    # And against the reference evaluated on the bf16 keys.
    check_against_reference(q, kb, vb, cfg, proj, lens, _build(kb, proj, cfg, lens), impl=impl)


def _reference_after_append(k, proj, cfg, lens_build, hidx, new_keys, counts_list):
    """Reference LSHIndex whose codes at appended positions are the host's (same function).

    A row whose hashed range was empty takes the mean of the first keys appended to it (float64
    here, checked against the host's, whose float32 value then centers the reference too)."""
    ri = _ref_build(k, proj, cfg, lens_build)
    codes = ri.codes
    end = ri.end
    mean, e = np.asarray(ri.mean, np.float64), np.asarray(end).copy()
    for k_new, counts in zip(new_keys, counts_list, strict=True):
        for b in range(k.shape[0]):
            if int(counts[b]) and e[b] == int(ri.start[b]):  # the first keys of an empty range
                mean[b] = np.asarray(k_new[b, :, : int(counts[b])], np.float64).mean(1)
        e = e + np.asarray(counts)
    np.testing.assert_allclose(np.asarray(hidx.mean), mean, rtol=0, atol=1e-5 * max(1.0, np.abs(mean).max()))
    ri = dataclasses.replace(ri, mean=hidx.mean)
    for k_new, counts in zip(new_keys, counts_list, strict=True):
        c = _key_codes(hidx, k_new)
        for b in range(k.shape[0]):
            e = int(end[b])
            n = int(counts[b])
            codes = codes.at[b, :, e : e + n].set(c[b, :, :n])
        end = end + jnp.asarray(counts, jnp.int32)
    return dataclasses.replace(ri, codes=codes, end=end)


@pytest.mark.parametrize("open_capacity", [1, 4, 64])
def test_append_matches_reference(open_capacity):
    B, Hq, Hkv, N, D = 2, 4, 2, 260, 16
    cfg, q, k, v, proj, _ = make_case(B, Hq, Hkv, N, D, 3, 6, [N, N], num_local=4, seed=3)
    lens_build = jnp.asarray([100, 37], jnp.int32)
    # The index is donated below: give it its own copy of the projections.
    hidx = host.host_build_index(k, jnp.array(proj, copy=True), cfg, lens_build, capacity=N, chunk_size=50,
                                 open_capacity=open_capacity)
    end = np.asarray(hidx.end).copy()
    new_keys, counts_list = [], []
    rng = np.random.default_rng(0)
    append = jax.jit(host.host_append, donate_argnums=0)
    for step in range(6):
        T = 9
        counts = rng.integers(0, T + 1, size=B).astype(np.int32)
        k_new = jnp.stack([k[b, :, end[b] : end[b] + T] for b in range(B)])
        hidx = append(hidx, k_new, jnp.asarray(counts))
        new_keys.append(k_new)
        counts_list.append(counts)
        end = end + counts
        np.testing.assert_array_equal(np.asarray(hidx.end), end)
        ri = _reference_after_append(k, proj, cfg, lens_build, hidx, new_keys, counts_list)
        lens = jnp.asarray(end + step, jnp.int32)  # a few generated, unhashed keys past the index
        check_against_reference(q, k, v, cfg, proj, lens, hidx, ref_index=ri, static_window=3)


def test_append_beyond_capacity_is_an_error():
    cfg, q, k, v, proj, lens = make_case(1, 2, 1, 40, 8, 3, 4, [40])
    hidx = host.host_build_index(k, proj, cfg, jnp.asarray([30]), capacity=40)
    hidx = host.host_append(hidx, k[:, :, 30:35])
    with pytest.raises(Exception, match="exceeds the index capacity"):
        jax.block_until_ready(host.host_append(hidx, k[:, :, 30:40]).bounds)


def test_inside_jit_and_threads():
    cfg, q, k, v, proj, lens = make_case(2, 4, 2, 300, 16, 4, 8, [300, 200])
    hidx = _build(k, proj, cfg, lens, chunk_size=128)
    f = jax.jit(lambda q, k, v, i, n: _host_attn(q, k, v, i, cfg, n))
    expect = _host_attn(q, k, v, hidx, cfg, lens)
    results = [None] * 4

    def run(i):
        results[i] = f(q, k, v, hidx, lens)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        for a, b in zip(r, results[0], strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(r[2]), np.asarray(expect[2]))
        assert_close(r[0], r[1], expect[0], expect[1])
    # max_threads=1 gives the same answer.
    one = _host_attn(q, k, v, hidx, cfg, lens, max_threads=1)
    np.testing.assert_array_equal(np.asarray(one[2]), np.asarray(expect[2]))


def test_host_build_codes_match_reference():
    cfg, q, k, v, proj, lens = make_case(2, 4, 2, 77, 16, 4, 8, [77, 30])
    ref = build_lsh_index(k, proj, cfg, lens)
    hidx = host.host_build_index(k, proj, cfg, lens, chunk_size=20)
    np.testing.assert_array_equal(np.asarray(hidx.mean), np.asarray(ref.mean))
    np.testing.assert_array_equal(np.asarray(host.host_key_codes(hidx, k)), np.asarray(ref.codes))
    check_against_reference(q, k, v, cfg, proj, lens, hidx)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("K,L", [(10, 150), (1, 2), (4, 8), (16, 300), (11, 300)])
def test_log_u_table_accuracy(K, L, impl):
    c = np.linspace(-1.0, 1.0, 40001, dtype=np.float32)
    c = np.concatenate([c, np.float32([-1.0, 1.0, -0.9999999, 0.9999999, 1e-30, -1e-30])])
    got = np.asarray(host.host_log_u(jnp.asarray(c), K, L, impl=impl))
    exact = log_u_exact(c, K, L)
    assert np.all(np.isfinite(got))
    np.testing.assert_array_less(np.abs(got - exact), 2e-5 + 1e-6 * np.abs(exact))


# ---------------------------------------------------------------------------------------------
# Bad inputs: clear Python errors, and the op's own checks (never a crash).
# ---------------------------------------------------------------------------------------------


def test_bad_inputs_raise():
    cfg, q, k, v, proj, lens = make_case(1, 2, 1, 40, 8, 3, 4, [40])
    hidx = host.host_build_index(k, proj, cfg, lens)
    with pytest.raises(ValueError, match="K must be in"):
        host.host_build_index(k, jnp.zeros((8, 34)), MagicPIGConfig(K=17, L=2), lens)
    with pytest.raises(ValueError, match="L must be in"):
        host.host_build_index(k, jnp.zeros((8, 5000)), MagicPIGConfig(K=1, L=5000), lens)
    with pytest.raises(ValueError, match="lengths must be in"):
        host.host_build_index(k, proj, cfg, jnp.asarray([41]))
    with pytest.raises(ValueError, match="capacity must be in"):
        host.host_build_index(k, proj, cfg, lens, capacity=10)
    with pytest.raises(ValueError, match="open_capacity"):
        host.host_build_index(k, proj, cfg, lens, open_capacity=0)
    with pytest.raises(ValueError, match="k must be"):
        host.host_build_index(k[0], proj, cfg, lens)
    with pytest.raises(TypeError, match="k must be a floating"):
        host.host_build_index(k.astype(jnp.int32), proj, cfg, lens)
    with pytest.raises(ValueError, match="projections"):
        host.host_build_index(k, proj[:, :-1], cfg, lens)
    with pytest.raises(TypeError, match="float32 or both bfloat16"):
        host.host_magicpig_attention(q, k.astype(jnp.float16), v.astype(jnp.float16), hidx, cfg, lens)
    with pytest.raises(TypeError, match="float32 or both bfloat16"):
        host.host_magicpig_attention(q, k, v.astype(jnp.bfloat16), hidx, cfg, lens)
    with pytest.raises(ValueError, match="k and v"):
        host.host_magicpig_attention(q, k, v[:, :, :-1], hidx, cfg, lens)
    with pytest.raises(ValueError, match="built with K=3"):
        host.host_magicpig_attention(q, k, v, hidx, MagicPIGConfig(K=4, L=4), lens)
    with pytest.raises(ValueError, match="lengths must be in"):
        host.host_magicpig_attention(q, k, v, hidx, cfg, jnp.asarray([41]))
    with pytest.raises(ValueError, match="lengths must be"):
        host.host_magicpig_attention(q, k, v, hidx, cfg, jnp.asarray([1, 2]))
    with pytest.raises(ValueError, match="impl must be one of"):
        host.host_magicpig_attention(q, k, v, hidx, cfg, lens, impl="avx512")
    with pytest.raises(ValueError, match="static_window"):
        host.host_magicpig_attention(q, k, v, hidx, cfg, lens, static_window=-1)
    with pytest.raises(TypeError, match="HostIndex"):
        host.host_magicpig_attention(q, k, v, build_lsh_index(k, proj, cfg, lens), cfg, lens)
    with pytest.raises(ValueError, match="counts must be in"):
        host.host_append(hidx, k[:, :, :3], jnp.asarray([4]))
    with pytest.raises(ValueError, match="k_new"):
        host.host_append(hidx, k[:, :, :3, :4])


def test_op_rejects_corrupt_or_mismatched_buffers():
    cfg, q, k, v, proj, lens = make_case(1, 2, 1, 40, 8, 3, 4, [40])
    hidx = host.host_build_index(k, proj, cfg, lens)
    qc = lsh.simhash_codes(q, proj, 3, 4)

    def run(idx, qc=qc, k=k, v=v):
        return jax.block_until_ready(host.host_sampled_attention(q, qc, k, v, idx, lens))

    bad = dataclasses.replace(hidx, bounds=hidx.bounds.at[0, 1].set(10_000))
    with pytest.raises(Exception, match="corrupt index bounds"):
        run(bad)
    bad = dataclasses.replace(hidx, offsets=hidx.offsets.at[0, 0, 0, :, 1:].set(60_000))
    with pytest.raises(Exception, match="corrupt index offsets"):
        run(bad)
    with pytest.raises(Exception, match="query code"):
        run(hidx, qc=qc.at[0, 0, 0].set(1 << 3))
    # Codes wider than K bits given to the build op directly.
    ri = build_lsh_index(k, proj, cfg, lens)
    types = (
        jax.ShapeDtypeStruct(hidx.ids.shape, jnp.uint16),
        jax.ShapeDtypeStruct(hidx.offsets.shape, jnp.uint16),
        jax.ShapeDtypeStruct(hidx.open_codes.shape, jnp.uint16),
        jax.ShapeDtypeStruct(hidx.bounds.shape, jnp.int32),
    )
    build = jax.ffi.ffi_call("magicpig_host_build", types)
    with pytest.raises(Exception, match="does not fit in K=3"):
        jax.block_until_ready(build(ri.codes.at[0, 0, 10, 0].set(8), ri.start, ri.end,
                                    K=np.int64(3), max_threads=np.int64(0)))
    with pytest.raises(Exception, match="hashed range"):
        jax.block_until_ready(build(ri.codes, ri.start, ri.end + 100, K=np.int64(3), max_threads=np.int64(0)))
    with pytest.raises(Exception, match="K must be in"):
        jax.block_until_ready(build(ri.codes, ri.start, ri.end, K=np.int64(0), max_threads=np.int64(0)))


# ---------------------------------------------------------------------------------------------
# Fuzz.
# ---------------------------------------------------------------------------------------------


# Structural presets (shapes, K, L, static set, chunking) keep the number of compilations small;
# hypothesis varies the lengths (full rows included), appended counts and data within them.
# (B, Hkv, G, N, D, K, L, num_sink, num_local, chunk, open, window, T)
PRESETS = [
    (1, 1, 1, 40, 8, 1, 2, 0, 0, 7, 1, 0, 6),
    (2, 2, 2, 96, 9, 3, 6, 4, 9, 16, 5, 6, 20),
    (3, 1, 3, 130, 16, 6, 12, 2, 20, 64, 12, 30, 20),
    (2, 2, 1, 70, 4, 4, 3, 5, 0, 70, 3, 3, 20),
    # the paper's K and L, D = 64, chunks that end inside the appended block
    (2, 1, 4, 300, 64, 10, 150, 4, 16, 128, 16, 8, 40),
    # K = 16 (the host maximum: 65,537 bucket starts per table), D = 128, one chunk per position block
    (1, 2, 2, 200, 128, 16, 20, 1, 5, 50, 7, 0, 24),
    # D = 1 and D = 33 (odd tails of the AVX2 rows), L > 2 ^ 6
    (2, 1, 2, 90, 1, 2, 70, 3, 3, 11, 2, 1, 10),
    (1, 3, 1, 150, 33, 8, 40, 0, 12, 150, 64, 40, 30),
]


@st.composite
def cases(draw, preset):
    B, N, T = preset[0], preset[3], preset[-1]
    # rows at their full length (N at the build, N + T after the append) as well as anywhere below
    lengths = draw(st.lists(st.one_of(st.just(N), st.integers(0, N)), min_size=B, max_size=B))
    grow = draw(st.lists(st.one_of(st.just(T), st.integers(0, T)), min_size=B, max_size=B))
    extra = draw(st.lists(st.one_of(st.just(N + T), st.integers(0, 8)), min_size=B, max_size=B))
    seed = draw(st.integers(0, 2**16))
    return preset, lengths, grow, extra, seed


# Every preset on every kernel, a few examples each (2; 1 under the sanitizer's profile of 10).
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("preset", PRESETS, ids=[f"preset{i}" for i in range(len(PRESETS))])
@settings(max_examples=min(2, settings.default.max_examples // 10), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_against_reference(preset, impl, data):
    preset, lengths, grow, extra, seed = data.draw(cases(preset))
    B, Hkv, G, N, D, K, L, num_sink, num_local, chunk, open_cap, window, T = preset
    # Gemma 2's attention logit soft-capping on every other preset (one compilation per preset)
    softcap = (None, 2.0)[PRESETS.index(preset) % 2]
    cap = N + T
    cfg, q, k, v, proj, lens_build = make_case(B, G * Hkv, Hkv, cap, D, K, L, lengths, num_sink=num_sink,
                                               num_local=num_local, seed=seed)
    hidx = _build(k, proj, cfg, lens_build, capacity=cap, chunk_size=chunk, open_capacity=open_cap)
    end = np.asarray(hidx.end)
    k_pad = jnp.concatenate([k, jnp.zeros_like(k[:, :, :T])], axis=2)
    k_new = jnp.stack([k_pad[b, :, end[b] : end[b] + T] for b in range(B)])
    counts = np.asarray(grow, np.int32)
    hidx = _append(hidx, k_new, jnp.asarray(counts))
    ri = _reference_after_append(k, proj, cfg, lens_build, hidx, [k_new], [counts])
    lens = jnp.asarray(np.minimum(end + counts + np.asarray(extra), cap), jnp.int32)
    check_against_reference(q, k, v, cfg, proj, lens, hidx, ref_index=ri, static_window=window, impl=impl,
                            softcap=softcap)


def test_advise_huge_pages_keeps_values_and_results():
    cfg, q, k, v, proj, lens = make_case(1, 4, 2, 4096, 128, 6, 10, [4096])
    hidx = host.host_build_index(k, proj, cfg, lens)
    before = _host_attn(q, k, v, hidx, cfg, lens)
    k_np, v_np = np.asarray(k), np.asarray(v)
    n = host.advise_huge_pages(k, v, hidx, {"not an array": 3})
    assert isinstance(n, int) and 0 <= n <= k.nbytes + v.nbytes + host.index_nbytes(hidx)
    np.testing.assert_array_equal(np.asarray(k), k_np)
    np.testing.assert_array_equal(np.asarray(v), v_np)
    after = _host_attn(q, k, v, hidx, cfg, lens)
    for a, b in zip(before, after, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert host.advise_huge_pages() == 0


def test_advise_huge_pages_leaves_a_sharded_arrays_devices_alone():
    """It popped the device out of the set JAX keeps for a one-device mesh's sharding: the array
    then reported no device and a later decode on that mesh failed with 'pop from an empty set'."""
    from magicpig_jax import distributed

    mesh = distributed.make_mesh(batch=1, kv_heads=1)
    z = jax.jit(lambda a: a + 1)(distributed.shard_kv(mesh, jnp.ones((1, 1, 8 << 10, 64))))  # 2 MiB: advised
    host.advise_huge_pages(z)
    assert z.devices() == {jax.devices()[0]}
    assert jax.jit(lambda a: a * 2)(distributed.shard_kv(mesh, jnp.ones((1, 1, 8, 4)))).devices() == {jax.devices()[0]}


def test_donating_a_host_index_keeps_the_callers_hyperplanes():
    """host_append's docstring says to donate the index: the index held the caller's projections
    array itself, so donating it deleted them."""
    cfg, q, k, v, proj, lens = make_case(1, 4, 2, 256, 32, 6, 10, [200])
    proj = jnp.asarray(proj, jnp.float32)
    hidx = host.host_build_index(k, proj, cfg, lens, capacity=512)
    jax.jit(host.host_append, donate_argnums=0)(hidx, k[:, :, :4], jnp.array([4], jnp.int32))
    assert not proj.is_deleted()
    host.host_build_index(k, proj, cfg, lens)  # usable for the next layer


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("K", [4, 8])
def test_one_row_split_over_threads_matches_reference(impl, K):
    # B * Hq = 1 head, fewer than the pool's threads: the op splits the head's positions into
    # pieces (>= 1024 positions each) and merges their (out, lse). Several chunks, appended keys
    # (merged into the sealed chunks and left in the open chunk) and an exact tail put piece
    # boundaries inside buckets, chunks and the open chunk. K = 4 gives long buckets (cut to a
    # piece by binary search), K = 8 short ones (walked whole, the ids outside the piece not
    # kept). The sampled set is exactly the reference's with one thread or with the whole pool.
    N = 6000
    cfg, q, k, v, proj, lens = make_case(1, 1, 1, N, 16, K, 8, [5000], cone=0.3)
    hidx = _build(k, proj, cfg, jnp.asarray([4000], jnp.int32), chunk_size=1500, open_capacity=300,
                  capacity=N)
    new_keys, counts = [], []
    for s in range(3997, 4997, 250):
        new_keys.append(k[:, :, s:s + 250])
        counts.append(np.asarray([250], np.int32))
        hidx = _append(hidx, new_keys[-1])
    start, end, sealed = np.asarray(hidx.bounds)[0]
    assert (start, end) == (2, 4997) and 4000 < sealed < end
    ri = _reference_after_append(k, proj, cfg, jnp.asarray([4000], jnp.int32), hidx, new_keys, counts)
    lens = jnp.asarray([5400], jnp.int32)  # 400 unhashed keys past the index
    one = check_against_reference(q, k, v, cfg, proj, lens, hidx, ref_index=ri, impl=impl, static_window=100,
                                  max_threads=1)
    pool = check_against_reference(q, k, v, cfg, proj, lens, hidx, ref_index=ri, impl=impl, static_window=100)
    np.testing.assert_array_equal(np.asarray(one), np.asarray(pool))
    assert int(np.asarray(one).sum()) > 0
    a = _host_attn(q, k, v, hidx, cfg, lens, impl=impl, static_window=100, max_threads=1)
    b = _host_attn(q, k, v, hidx, cfg, lens, impl=impl, static_window=100)
    assert_close(a[0], a[1], b[0], b[1], tol=2e-6)
