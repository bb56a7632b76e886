"""magicpig_jax.host.build against the index layout written out in float64 NumPy.

The tables the build and the appends leave are compared with the layout of
``host_ops/magicpig_host.cc`` (and :class:`~magicpig_jax.host.index.HostIndex`) computed here
from scratch: the SimHash codes of the keys centered by the float64 mean of the hashed range
(or of a row's first appended keys), chunk ``c`` holding positions ``[c*CH, (c+1)*CH)`` sorted
by bucket (ascending positions within a bucket), ``offsets`` the bucket starts, the open chunk
holding ``[sealed_end, end)`` in order. Also the exact messages and inclusive bounds of every
argument, the dtypes under x64, ``vmap``, and the in-place append under ``jit`` with donation.

Written for the surviving mutants of ``mutmut`` (docs/mutation.md, ``host/build.py``).
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magicpig_jax import host
from magicpig_jax.attention.config import MagicPIGConfig
from magicpig_jax.host import build as host_build
from magicpig_jax.host.index import HostIndex

CFG = MagicPIGConfig(K=3, L=4, num_sink=2, num_local=4)
B, HKV, N, D = 2, 2, 48, 8
CH, OPEN = 16, 5


def _exact(message: str):
    """``pytest.raises(match=...)`` for the whole message, literally."""
    return "^" + re.escape(message) + "$"


def _keys(seed=3):
    rng = np.random.default_rng(seed)
    # a cone (a common offset per KV head), so that an uncentered code differs from a centered one
    k = rng.normal(size=(B, HKV, N, D)) + 3.0 * rng.normal(size=(1, HKV, 1, D))
    proj = rng.normal(size=(D, CFG.K * CFG.L))
    return k.astype(np.float32), proj.astype(np.float32)


def _np_codes(x: np.ndarray, proj: np.ndarray, K: int, L: int) -> np.ndarray:
    """float64 SimHash codes ``[..., L]``: bit j of table l is ``x . proj[:, l*K + j] > 0``."""
    y = np.asarray(x, np.float64) @ np.asarray(proj, np.float64)
    # no projection near 0, so that float32 rounding cannot flip a bit of the library's codes (0 exactly:
    # a key equal to the mean, the first mean of one key, is 0 in float32 too)
    assert np.all((np.abs(y) > 1e-4) | (y == 0))
    bits = (y > 0).reshape(*x.shape[:-1], L, K)
    return (bits * (1 << np.arange(K))).sum(-1)


def _np_sorted(codes_bh: np.ndarray, start: int, sealed: int, nc: int, ch: int, K: int, L: int):
    """Expected ``ids [NC, L, CH]`` (past each chunk's count: 0) and ``offsets [NC, L, 2^K + 1]`` of
    one (row, head) whose positions ``[start, sealed)`` have the codes ``codes_bh[pos] ([L])``."""
    ids = np.zeros((nc, L, ch), np.int64)
    offsets = np.zeros((nc, L, (1 << K) + 1), np.int64)
    for c in range(nc):
        pos = np.arange(max(start, c * ch), min(sealed, (c + 1) * ch))
        for t in range(L):
            code = codes_bh[pos, t] if pos.size else np.zeros(0, np.int64)
            order = np.argsort(code, kind="stable")
            ids[c, t, : pos.size] = pos[order] - c * ch
            offsets[c, t, 1:] = np.cumsum(np.bincount(code, minlength=1 << K))
    return ids, offsets


def _check_layout(hidx: HostIndex, codes: np.ndarray, bounds: np.ndarray, nc: int, ch: int, open_cap: int):
    """``hidx`` holds, per row b and head h, the positions ``[start, sealed)`` of ``codes [B, Hkv, N, L]``
    sorted into its chunks and ``[sealed, end)`` in its open chunk; ``bounds [B, 3]`` as given."""
    K, L = hidx.K, hidx.L
    assert hidx.ids.shape == (B, HKV, nc, L, ch) and hidx.ids.dtype == jnp.uint16
    assert hidx.offsets.shape == (B, HKV, nc, L, (1 << K) + 1) and hidx.offsets.dtype == jnp.uint16
    assert hidx.open_codes.shape == (B, HKV, L, open_cap) and hidx.open_codes.dtype == jnp.uint16
    assert hidx.bounds.shape == (B, 3) and hidx.bounds.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(hidx.bounds), bounds)
    ids, offsets, open_codes = (np.asarray(x).astype(np.int64) for x in (hidx.ids, hidx.offsets, hidx.open_codes))
    for b in range(B):
        start, end, sealed = (int(x) for x in bounds[b])
        for h in range(HKV):
            e_ids, e_off = _np_sorted(codes[b, h], start, sealed, nc, ch, K, L)
            np.testing.assert_array_equal(offsets[b, h], e_off, err_msg=f"offsets of row {b}, head {h}")
            for c in range(nc):
                n = e_off[c, 0, -1]
                np.testing.assert_array_equal(ids[b, h, c, :, :n], e_ids[c, :, :n], err_msg=f"ids {b} {h} {c}")
            np.testing.assert_array_equal(open_codes[b, h, :, : end - sealed], codes[b, h, sealed:end].T)


def _np_mean(k: np.ndarray, lo, hi) -> np.ndarray:
    """float64 mean ``[B, Hkv, D]`` of the keys ``[lo[b], hi[b])`` of each row (0 where empty)."""
    return np.stack([k[b, :, lo[b]:hi[b]].astype(np.float64).mean(1) if hi[b] > lo[b] else np.zeros((HKV, D))
                     for b in range(B)])


def test_host_build_index_tables_against_float64_layout():
    # row 0 hashes [2, 26) (chunks 0 and 1 of 16), row 1 [2, 15); capacity 48 = 3 chunks
    k, proj = _keys()
    lengths = np.array([30, 19], np.int32)
    hidx = host.host_build_index(jnp.asarray(k), jnp.asarray(proj), CFG, jnp.asarray(lengths), capacity=N,
                                 open_capacity=OPEN, chunk_size=CH)
    assert isinstance(hidx, HostIndex) and (hidx.K, hidx.L) == (3, 4)
    mean = _np_mean(k, [2, 2], [26, 15])
    assert hidx.mean.dtype == jnp.float32 and hidx.projections.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(hidx.mean), mean, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(hidx.projections), proj)
    codes = _np_codes(k - mean[:, :, None, :], proj, 3, 4)
    _check_layout(hidx, codes, np.array([[2, 26, 26], [2, 15, 15]]), 3, CH, OPEN)
    np.testing.assert_array_equal(np.asarray(hidx.open_codes), 0)  # the build leaves the open chunk empty


def test_host_build_index_defaults_bounds_and_messages():
    k, proj = _keys()
    kj, pj = jnp.asarray(k), jnp.asarray(proj)
    # defaults: every row of length N ([2, 44) hashed), capacity N in one chunk, an open chunk of 512
    hidx = host.host_build_index(kj, pj, CFG)
    mean = _np_mean(k, [2, 2], [44, 44])
    np.testing.assert_allclose(np.asarray(hidx.mean), mean, rtol=0, atol=1e-5)
    _check_layout(hidx, _np_codes(k - mean[:, :, None, :], proj, 3, 4), np.array([[2, 44, 44]] * 2), 1, N, 512)
    # capacity past N: the fewest balanced chunks of <= 65535 positions (here one of 100)
    assert host.host_build_index(kj, pj, CFG, capacity=100).ids.shape == (B, HKV, 1, 4, 100)
    assert host.host_build_index(kj, pj, CFG, capacity=N, chunk_size=7).ids.shape == (B, HKV, 7, 4, 7)
    # the inclusive bounds are accepted
    for kw in (dict(open_capacity=1), dict(open_capacity=65535), dict(max_threads=0), dict(max_threads=4096),
               dict(chunk_size=1), dict(chunk_size=65535)):
        got = host.host_build_index(kj, pj, CFG, jnp.asarray([30, 19], jnp.int32), **kw)
        np.testing.assert_array_equal(np.asarray(got.bounds), [[2, 26, 26], [2, 15, 15]])
    assert host.host_build_index(kj, pj, CFG, open_capacity=65535).open_codes.shape == (B, HKV, 4, 65535)
    assert host.host_build_index(kj, pj, CFG, chunk_size=1).ids.shape == (B, HKV, N, 4, 1)
    cases = [
        (dict(capacity=N - 1), ValueError, f"capacity must be in [{N}, 2147483647], got capacity={N - 1}"),
        (dict(capacity=2**31), ValueError, f"capacity must be in [{N}, 2147483647], got capacity=2147483648"),
        (dict(capacity=float(N)), TypeError, f"capacity must be an int, got float {float(N)!r}"),
        (dict(open_capacity=0), ValueError, "open_capacity must be in [1, 65535], got open_capacity=0"),
        (dict(open_capacity=65536), ValueError, "open_capacity must be in [1, 65535], got open_capacity=65536"),
        (dict(max_threads=-1), ValueError, "max_threads must be in [0, 4096], got max_threads=-1"),
        (dict(max_threads=4097), ValueError, "max_threads must be in [0, 4096], got max_threads=4097"),
        (dict(max_threads=True), TypeError, "max_threads must be an int, got bool True"),
        (dict(chunk_size=0), ValueError, "chunk_size must be in [1, 65535], got chunk_size=0"),
        (dict(chunk_size=65536), ValueError, "chunk_size must be in [1, 65535], got chunk_size=65536"),
        (dict(lengths=jnp.asarray([30, 49], jnp.int32)), ValueError,
         f"lengths must be in [0, {N}] (the KV capacity), got [30, 49]"),
    ]
    for kw, err, msg in cases:
        with pytest.raises(err, match=_exact(msg)):
            host.host_build_index(kj, pj, CFG, **kw)
    with pytest.raises(ValueError, match=_exact("k must be [B, Hkv, N, D], got shape (2, 48, 8)")):
        host.host_build_index(kj[:, 0], pj, CFG)
    with pytest.raises(ValueError, match=_exact("k must be [B, Hkv, N, D], got shape ()")):
        host.host_build_index([[[[0.0]]]], pj, CFG)
    with pytest.raises(TypeError, match=_exact("k must be a floating dtype (float32 or bfloat16), got int32")):
        host.host_build_index(kj.astype(jnp.int32), pj, CFG)
    with pytest.raises(TypeError, match=_exact("config must be a MagicPIGConfig, got dict")):
        host.host_build_index(kj, pj, {"K": 3, "L": 4})


def test_host_build_index_x64_and_vmap():
    k, proj = _keys()
    lengths = np.array([30, 19])
    mean = _np_mean(k, [2, 2], [26, 15])
    codes = _np_codes(k - mean[:, :, None, :], proj, 3, 4)
    bounds = np.array([[2, 26, 26], [2, 15, 15]])
    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        # float64 keys and projections, int64 lengths: the index is still float32 / int32 / uint16
        hidx = host.host_build_index(jnp.asarray(k, jnp.float64), jnp.asarray(proj, jnp.float64), CFG,
                                     jnp.asarray(lengths, jnp.int64), capacity=N, open_capacity=OPEN, chunk_size=CH)
        assert hidx.mean.dtype == jnp.float32 and hidx.projections.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(hidx.mean), mean, rtol=0, atol=1e-5)
        _check_layout(hidx, codes, bounds, 3, CH, OPEN)
    # vmap over a stack of two caches (the op runs once per cache)
    k2 = np.stack([k, k[:, :, ::-1]])
    got = jax.vmap(lambda kk: host.host_build_index(kk, jnp.asarray(proj), CFG, capacity=N, open_capacity=OPEN,
                                                    chunk_size=CH))(jnp.asarray(k2))
    for i in range(2):
        one = jax.tree.map(lambda x: x[i], got)  # noqa: B023
        m = _np_mean(k2[i], [2, 2], [44, 44])
        np.testing.assert_allclose(np.asarray(one.mean), m, rtol=0, atol=1e-5)
        _check_layout(one, _np_codes(k2[i] - m[:, :, None, :], proj, 3, 4), np.array([[2, 44, 44]] * 2), 3, CH, OPEN)


def _sealed(end: int, sealed: int, count: int, open_cap: int) -> int:
    """The op's rule: the open chunk fills to ``open_cap``; a key arriving at a full open chunk first
    seals it into the sorted chunks."""
    o = end - sealed
    if count > 0 and o + count > open_cap:
        o = (o + count - 1) % open_cap + 1
    else:
        o += count
    return end + count - o


def test_host_append_tables_first_mean_and_counts_against_float64_layout():
    # row 0 hashes [2, 26) at the build; row 1 (length 5) hashes nothing: its first append sets the mean
    k, proj = _keys(4)
    hidx = host.host_build_index(jnp.asarray(k), jnp.asarray(proj), CFG, jnp.asarray([30, 5], jnp.int32),
                                 capacity=N, open_capacity=OPEN, chunk_size=CH)
    np.testing.assert_array_equal(np.asarray(hidx.bounds), [[2, 26, 26], [2, 2, 2]])
    mean = _np_mean(k, [2, 2], [26, 2])
    np.testing.assert_array_equal(np.asarray(hidx.mean[1]), 0.0)
    bounds = np.array([[2, 26, 26], [2, 2, 2]])
    # (T, counts): one key into the empty row (its mean is that key), then the default T = 6 (crossing
    # the open chunk's capacity and the chunk boundary at 32), then nothing into row 0
    for T, counts in ((6, [5, 1]), (6, None), (4, [0, 4]), (3, [3, 3])):
        cnt = [T, T] if counts is None else counts
        k_new = np.full((B, HKV, T, D), np.nan, np.float32)  # rows past the counts hold NaN
        for b in range(B):
            k_new[b, :, : cnt[b]] = k[b, :, bounds[b, 1]: bounds[b, 1] + cnt[b]]
        if bounds[1, 1] == bounds[1, 0] and cnt[1] > 0:  # the first append into row 1: its mean
            mean[1] = k[1, :, 2: 2 + cnt[1]].astype(np.float64).mean(1)
        args = () if counts is None else (jnp.asarray(counts, jnp.int32),)
        hidx = host.host_append(hidx, jnp.asarray(k_new), *args)
        for b in range(B):
            new_end = bounds[b, 1] + cnt[b]
            bounds[b] = [2, new_end, _sealed(bounds[b, 1], bounds[b, 2], cnt[b], OPEN)]
        assert hidx.mean.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(hidx.mean), mean, rtol=0, atol=1e-5)
        _check_layout(hidx, _np_codes(k - mean[:, :, None, :], proj, 3, 4), bounds, 3, CH, OPEN)
    np.testing.assert_array_equal(bounds, [[2, 40, 36], [2, 16, 12]])  # both rows sealed part of the way


def test_first_mean_of_one_key_counts_and_a_kept_mean():
    k, proj = _keys(5)
    hidx = host.host_build_index(jnp.asarray(k), jnp.asarray(proj), CFG, jnp.asarray([6, 5], jnp.int32))
    np.testing.assert_array_equal(np.asarray(hidx.bounds[:, :2]), [[2, 2], [2, 2]])  # both rows empty
    k_new = np.full((B, HKV, 4, D), np.inf, np.float32)
    k_new[0, :, :1] = k[0, :, 10:11]  # one key into row 0: its mean is that key
    k_new[1, :, :3] = k[1, :, 20:23]  # three of four into row 1
    new = host_build.first_mean(hidx, jnp.asarray(k_new), jnp.asarray([1, 3], jnp.int32))
    expect = np.stack([k[0, :, 10], k[1, :, 20:23].astype(np.float64).mean(1)])
    np.testing.assert_allclose(np.asarray(new.mean), expect, rtol=0, atol=1e-6)
    # an empty row that appends nothing keeps its mean, whatever it is
    marked = dataclasses.replace(hidx, mean=jnp.full((B, HKV, D), 7.0, jnp.float32))
    kept = host_build.first_mean(marked, jnp.asarray(k_new), jnp.asarray([0, 0], jnp.int32))
    np.testing.assert_array_equal(np.asarray(kept.mean), 7.0)
    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):  # float64 keys (int32 counts: host_append's)
        new64 = host_build.first_mean(hidx, jnp.asarray(k_new, jnp.float64), jnp.asarray([1, 3], jnp.int32))
        assert new64.mean.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(new64.mean), expect, rtol=0, atol=1e-6)


def test_host_key_codes_against_float64():
    k, proj = _keys(6)
    hidx = host.host_build_index(jnp.asarray(k), jnp.asarray(proj), CFG, jnp.asarray([40, 30], jnp.int32))
    mean = _np_mean(k, [2, 2], [36, 26])
    expect = _np_codes(k[:, :, 40:] - mean[:, :, None, :], proj, 3, 4)
    got = host_build.host_key_codes(hidx, jnp.asarray(k[:, :, 40:]))
    assert got.dtype == jnp.uint32 and got.shape == (B, HKV, 8, 4)
    np.testing.assert_array_equal(np.asarray(got), expect)
    with jax.enable_x64(True):
        got64 = host_build.host_key_codes(hidx, jnp.asarray(k[:, :, 40:], jnp.float64))
        assert got64.dtype == jnp.uint32
        np.testing.assert_array_equal(np.asarray(got64), expect)


def test_host_append_messages_bounds_x64_and_vmap():
    k, proj = _keys(7)
    kj = jnp.asarray(k)
    hidx = host.host_build_index(kj, jnp.asarray(proj), CFG, jnp.asarray([30, 20], jnp.int32), capacity=N,
                                 open_capacity=OPEN, chunk_size=CH)
    k_new = kj[:, :, 30:33]
    # the next three keys of each row (row 0 hashes [2, 26), row 1 [2, 16))
    k_app = jnp.asarray(np.stack([k[0, :, 26:29], k[1, :, 16:19]]))
    cases = [
        (dict(index="x"), TypeError, "index must be a HostIndex, got str"),
        (dict(k_new=k_new[:, 0]), ValueError, "k_new must be [B, Hkv, T, D], got shape (2, 3, 8)"),
        (dict(k_new=[[[[0.0]]]]), ValueError, "k_new must be [B, Hkv, T, D], got shape ()"),
        (dict(k_new=k_new.astype(jnp.int32)), TypeError, "k_new must be a floating dtype, got int32"),
        (dict(k_new=kj[:, :, :3, :5]), ValueError, "k_new (2, 2, 3, 5) does not match the index (mean (2, 2, 8))"),
        (dict(k_new=kj[:1, :, :3]), ValueError, "k_new (1, 2, 3, 8) does not match the index (mean (2, 2, 8))"),
        (dict(max_threads=-1), ValueError, "max_threads must be in [0, 4096], got max_threads=-1"),
        (dict(max_threads=4097), ValueError, "max_threads must be in [0, 4096], got max_threads=4097"),
        (dict(max_threads=1.0), TypeError, "max_threads must be an int, got float 1.0"),
        (dict(counts=np.array([1, 2, 3])), ValueError, "counts must be int [B] = [2], got int64 [3]"),
        (dict(counts=np.array([1.0, 2.0])), ValueError, "counts must be int [B] = [2], got float64 [2]"),
        (dict(counts=np.array([-1, 2])), ValueError, "counts must be in [0, T=3], got [-1, 2]"),
        (dict(counts=np.array([1, 4])), ValueError, "counts must be in [0, T=3], got [1, 4]"),
    ]
    for kw, err, msg in cases:
        args = dict(index=hidx, k_new=k_new)
        args.update(kw)
        with pytest.raises(err, match=_exact(msg)):
            host.host_append(**args)
    # the traced path of the counts' check (under jit) gives the same messages for shape and dtype
    for counts, msg in ((jnp.asarray([1.0, 2.0]), "counts must be int [B] = [2], got float32 [2]"),
                        (jnp.asarray([1, 2, 3], jnp.int32), "counts must be int [B] = [2], got int32 [3]")):
        with pytest.raises(ValueError, match="^" + re.escape(msg) + "(\n|$)"):  # JAX may add a note
            jax.jit(lambda c: host.host_append(hidx, k_new, c).bounds)(counts)  # noqa: B023
    # the inclusive bounds: counts 0 and T, max_threads 0 and 4096
    mean = _np_mean(k, [2, 2], [26, 16])
    codes = _np_codes(k - mean[:, :, None, :], proj, 3, 4)
    got = host.host_append(hidx, k_app, np.array([0, 3]), max_threads=4096)
    _check_layout(got, codes, np.array([[2, 26, 26], [2, 19, 16]]), 3, CH, OPEN)
    got = host.host_append(hidx, k_app, np.array([3, 0]), max_threads=0)
    _check_layout(got, codes, np.array([[2, 29, 26], [2, 16, 16]]), 3, CH, OPEN)
    # under jit the counts are traced (not checked by value): the op appends them
    got = jax.jit(lambda c: host.host_append(hidx, k_app, c))(jnp.asarray([2, 0], jnp.int32))
    _check_layout(got, codes, np.array([[2, 28, 26], [2, 16, 16]]), 3, CH, OPEN)
    # x64: float64 keys, int64 counts and the default counts reach the op as float32 codes and int32 counts
    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        got = host.host_append(hidx, k_app.astype(jnp.float64), jnp.asarray([3, 0], jnp.int64))
        _check_layout(got, codes, np.array([[2, 29, 26], [2, 16, 16]]), 3, CH, OPEN)
        got = host.host_append(hidx, k_app.astype(jnp.float64))
        assert got.bounds.dtype == jnp.int32 and got.mean.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got.bounds), [[2, 29, 26], [2, 19, 16]])
    # vmap over a stack of two indices and their new keys (the op runs once per index)
    stacked = jax.tree.map(lambda x: jnp.stack([x, x]), hidx)
    k2 = jnp.stack([k_app, k_app])
    got = jax.vmap(lambda ix, kn, c: host.host_append(ix, kn, c))(stacked, k2, jnp.asarray([[3, 0], [1, 0]], jnp.int32))
    _check_layout(jax.tree.map(lambda x: x[0], got), codes, np.array([[2, 29, 26], [2, 16, 16]]), 3, CH, OPEN)
    _check_layout(jax.tree.map(lambda x: x[1], got), codes, np.array([[2, 27, 26], [2, 16, 16]]), 3, CH, OPEN)


def test_host_append_aliases_the_index_buffers_and_is_in_place_under_jit_with_donation():
    # the four buffers are aliased input -> output (the custom call's output_operand_aliases: output i is
    # operand i, the ids, offsets, open codes and bounds): with the index donated, the op writes into them
    # instead of into copies (the values are the same either way: checked below)
    k, proj = _keys(8)
    kj = jnp.asarray(k)
    hidx = host.host_build_index(kj, jnp.asarray(proj), CFG, jnp.asarray([30, 20], jnp.int32), capacity=N,
                                 open_capacity=OPEN, chunk_size=CH)
    k_app = jnp.asarray(np.stack([k[0, :, 26:29], k[1, :, 16:19]]))
    append = jax.jit(lambda ix, kn: host.host_append(ix, kn), donate_argnums=0)
    text = append.lower(hidx, k_app).as_text()
    calls = [line for line in text.splitlines() if "custom_call @magicpig_host_append(" in line]
    assert len(calls) == 1
    assert re.search(r"magicpig_host_append\(%arg0, %arg1, %arg2, %arg3, ", calls[0])
    aliases = re.findall(r"output_tuple_indices = \[(\d+)\], operand_index = (\d+)", calls[0])
    assert sorted(aliases) == [("0", "0"), ("1", "1"), ("2", "2"), ("3", "3")]
    before = [x.unsafe_buffer_pointer() for x in (hidx.ids, hidx.offsets, hidx.open_codes, hidx.bounds)]
    got = append(hidx, k_app)
    assert [x.unsafe_buffer_pointer() for x in (got.ids, got.offsets, got.open_codes, got.bounds)] == before
    mean = _np_mean(k, [2, 2], [26, 16])
    _check_layout(got, _np_codes(k - mean[:, :, None, :], proj, 3, 4), np.array([[2, 29, 26], [2, 19, 16]]), 3,
                  CH, OPEN)
