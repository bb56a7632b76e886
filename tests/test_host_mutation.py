"""The Python side of the host ops (``magicpig_jax.host``) on cases computed by hand: the argument
checks and their exact messages, the index geometry and bytes, the ``log u`` table's size and
its float64 form against SciPy, and the pure-JAX helpers (Quest page bounds, TopK ranges, the
first mean of an append) against float64 NumPy.

Written for the surviving mutants of ``mutmut`` (docs/mutation.md, "host/"): each test fixes a
value or a message that a mutant changed without any other test noticing.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import re
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats

from magicpig_jax import host
from magicpig_jax.attention.config import MagicPIGConfig
from magicpig_jax.attention.magicpig import LOG_U_FLOOR, build_lsh_index, hashed_mean
from magicpig_jax.host import _ext, validate
from magicpig_jax.host.index import DEFAULT_OPEN_CAPACITY, MAX_CHUNK, HostIndex, chunk_geometry, index_nbytes
from magicpig_jax.host.log_u import LOG_U_TABLE_SIZE, host_log_u, log_u_exact, log_u_table, table_size
from magicpig_jax.host.quest import (
    QuestPages,
    quest_append_pages,
    quest_build_pages,
    quest_page_bytes,
    quest_pages_kept,
)
from magicpig_jax.host.topk import range_bounds


def _exact(message: str):
    """``pytest.raises(match=...)`` for the whole message, literally."""
    return "^" + re.escape(message) + "$"


# -- _ext --------------------------------------------------------------------------------------


def test_impl_codes_and_message():
    assert [_ext.impl_code(n) for n in ("auto", "scalar", "avx2")] == [0, 1, 2]
    with pytest.raises(ValueError, match=_exact("impl must be one of ['auto', 'avx2', 'scalar'], got 'sse'")):
        _ext.impl_code("sse")


def test_load_reads_the_library_the_variable_names(monkeypatch, tmp_path):
    lib = Path(_ext.ops().__file__)  # the built extension (installed, or named by the variable)
    monkeypatch.setenv("MAGICPIG_HOST_OPS_LIB", str(lib))
    mod = _ext._load()
    assert mod.__name__ == _ext.EXTENSION == "magicpig_jax._host_ops"
    assert Path(mod.__file__) == lib and callable(mod.registrations) and isinstance(mod.has_avx2(), bool)
    bad = tmp_path / "not_an_extension.txt"
    bad.write_text("")
    monkeypatch.setenv("MAGICPIG_HOST_OPS_LIB", str(bad))
    with pytest.raises(ImportError, match=_exact(f"MAGICPIG_HOST_OPS_LIB={str(bad)!r} is not a loadable extension "
                                                 "module")):
        _ext._load()


def test_load_without_the_variable_imports_the_package_module(monkeypatch):
    monkeypatch.delenv("MAGICPIG_HOST_OPS_LIB", raising=False)
    asked = []
    sentinel = object()

    def found(name):
        asked.append(name)
        return sentinel

    monkeypatch.setattr(importlib, "import_module", found)
    assert _ext._load() is sentinel and asked == ["magicpig_jax._host_ops"]

    def missing(name):
        raise ImportError(f"No module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", missing)
    with pytest.raises(ImportError, match=_exact("magicpig_jax._host_ops is not built; reinstall the package with "
                                                 "`pip install -e .` (scikit-build-core + CMake compile host_ops/)")):
        _ext._load()


def test_has_avx2_is_what_the_cpu_reports():
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert flags, "no CPU flags in /proc/cpuinfo"
    assert host.has_avx2() is ({"avx2", "fma", "f16c"} <= flags)


# -- validate ----------------------------------------------------------------------------------


def test_check_int_bounds_are_inclusive_and_messages_exact():
    assert validate.check_int("w", 3, 3, 5) == 3
    assert validate.check_int("w", 5, 3, 5) == 5
    got = validate.check_int("w", np.int64(4), 3, 5)
    assert got == 4 and type(got) is int
    with pytest.raises(ValueError, match=_exact("w must be in [3, 5], got w=2")):
        validate.check_int("w", 2, 3, 5)
    with pytest.raises(ValueError, match=_exact("w must be in [3, 5], got w=6")):
        validate.check_int("w", 6, 3, 5)
    with pytest.raises(TypeError, match=_exact("w must be an int, got bool True")):
        validate.check_int("w", True, 0, 5)
    with pytest.raises(TypeError, match=_exact("w must be an int, got float 3.0")):
        validate.check_int("w", 3.0, 0, 5)


def test_check_config_bounds_and_messages():
    for K, L in ((1, 2), (16, 2), (16, 4096)):
        validate.check_config(MagicPIGConfig(K=K, L=L))
    with pytest.raises(ValueError, match=re.escape("K must be in [1, 16] for the host index (2^K + 1 bucket offsets "
                                                   "per chunk and table), got K=17; use the pure-JAX path")):
        validate.check_config(MagicPIGConfig(K=17, L=4))
    with pytest.raises(ValueError, match=_exact("L must be in [2, 4096] for the host index, got L=4097")):
        validate.check_config(MagicPIGConfig(K=4, L=4097))
    with pytest.raises(TypeError, match=_exact("config must be a MagicPIGConfig, got dict")):
        validate.check_config({"K": 4, "L": 8})


def test_check_lengths_strict_bounds_and_message():
    np.testing.assert_array_equal(np.asarray(validate.check_lengths_strict(jnp.asarray([0, 7]), 2, 7)), [0, 7])
    np.testing.assert_array_equal(np.asarray(validate.check_lengths_strict(None, 2, 7)), [7, 7])
    with pytest.raises(ValueError, match=_exact("lengths must be in [0, 7] (the KV capacity), got [8, 0]")):
        validate.check_lengths_strict(jnp.asarray([8, 0]), 2, 7)
    with pytest.raises(ValueError, match=_exact("ctx must be in [0, 7] (the KV capacity), got [0, -1]")):
        validate.check_lengths_strict(jnp.asarray([0, -1]), 2, 7, name="ctx")
    # a float array is not checked here: check_lengths refuses it by its dtype
    with pytest.raises(TypeError, match="integer array"):
        validate.check_lengths_strict(jnp.asarray([9.0, -1.0]), 2, 7)
    # an empty batch passes
    assert validate.check_lengths_strict(jnp.zeros((0,), jnp.int32), 0, 7).shape == (0,)
    # traced lengths are not read: they are clipped, as check_lengths does
    clipped = jax.jit(lambda n: validate.check_lengths_strict(n, 2, 7))(jnp.asarray([3, 9]))
    np.testing.assert_array_equal(np.asarray(clipped), [3, 7])


def test_check_kv_dtypes_pairs_and_message():
    f32 = jnp.zeros((1,), jnp.float32)
    bf16 = jnp.zeros((1,), jnp.bfloat16)
    f16 = jnp.zeros((1,), jnp.float16)
    validate.check_kv_dtypes(f32, f32)
    validate.check_kv_dtypes(bf16, bf16)
    with pytest.raises(TypeError, match=_exact("k and v must both be float32 or both bfloat16, got float32 and "
                                               "bfloat16")):
        validate.check_kv_dtypes(f32, bf16)
    with pytest.raises(TypeError, match=_exact("k and v must both be float32 or both bfloat16, got float16 and "
                                               "float16")):
        validate.check_kv_dtypes(f16, f16)


def _index(B=2, Hkv=3, NC=2, L=4, CH=5, K=2, OPEN=6, D=8, **replace):
    fields = dict(
        ids=jnp.zeros((B, Hkv, NC, L, CH), jnp.uint16),
        offsets=jnp.zeros((B, Hkv, NC, L, (1 << K) + 1), jnp.uint16),
        open_codes=jnp.zeros((B, Hkv, L, OPEN), jnp.uint16),
        bounds=jnp.zeros((B, 3), jnp.int32),
        mean=jnp.zeros((B, Hkv, D), jnp.float32),
        projections=jnp.zeros((D, K * L), jnp.float32),
    )
    fields.update(replace)
    return HostIndex(**fields, K=K, L=L)


def test_check_index_names_each_buffer():
    cfg = MagicPIGConfig(K=2, L=4)
    validate.check_index(_index(), cfg, 2, 3, 8)
    with pytest.raises(TypeError, match=_exact("index must be a HostIndex, got tuple")):
        validate.check_index((), cfg, 2, 3, 8)
    with pytest.raises(ValueError, match=_exact("index was built with K=2, L=4 but config has K=3, L=4")):
        validate.check_index(_index(), MagicPIGConfig(K=3, L=4), 2, 3, 8)
    with pytest.raises(ValueError, match=_exact("index was built with K=2, L=4 but config has K=2, L=5")):
        validate.check_index(_index(), MagicPIGConfig(K=2, L=5), 2, 3, 8)
    bad = {
        "ids": (jnp.zeros((2, 3, 2, 4, 5), jnp.int32), "index.ids must be uint16 [2, 3, 2, 4, 5], got int32 "
                "[2, 3, 2, 4, 5]"),
        "offsets": (jnp.zeros((2, 3, 2, 4, 4), jnp.uint16), "index.offsets must be uint16 [2, 3, 2, 4, 5], got uint16 "
                    "[2, 3, 2, 4, 4]"),
        "open_codes": (jnp.zeros((2, 3, 5, 6), jnp.uint16), "index.open_codes must be uint16 [2, 3, 4, 6], got "
                       "uint16 [2, 3, 5, 6]"),
        "bounds": (jnp.zeros((2, 2), jnp.int32), "index.bounds must be int32 [2, 3], got int32 [2, 2]"),
        "mean": (jnp.zeros((2, 3, 8), jnp.bfloat16), "index.mean must be float32 [2, 3, 8], got bfloat16 [2, 3, 8]"),
        "projections": (jnp.zeros((8, 9), jnp.float32), "index.projections must be float32 [8, 8], got float32 "
                        "[8, 9]"),
    }
    for name, (value, message) in bad.items():
        with pytest.raises(ValueError, match=_exact(message)):
            validate.check_index(_index(**{name: value}), cfg, 2, 3, 8)
    # the old int32 offsets of the right shape are refused by their dtype
    message = "index.offsets must be uint16 [2, 3, 2, 4, 5], got int32 [2, 3, 2, 4, 5]"
    with pytest.raises(ValueError, match=_exact(message)):
        validate.check_index(_index(offsets=jnp.zeros((2, 3, 2, 4, 5), jnp.int32)), cfg, 2, 3, 8)
    # the caller's B, Hkv and D are each checked
    for B, Hkv, D in ((1, 3, 8), (2, 2, 8), (2, 3, 7)):
        with pytest.raises(ValueError, match="^index\\."):
            validate.check_index(_index(), cfg, B, Hkv, D)


# -- index -------------------------------------------------------------------------------------


def test_chunk_geometry_by_hand():
    assert MAX_CHUNK == 65535 and DEFAULT_OPEN_CAPACITY == 512  # a full chunk's count fits the uint16 offsets
    cases = {0: (0, 1), -3: (0, 1), 1: (1, 1), 65535: (1, 65535), 65536: (2, 32768), 65537: (2, 32769),
             131070: (2, 65535), 131071: (3, 43691), 131073: (3, 43691), 200000: (4, 50000)}
    for capacity, expect in cases.items():
        assert chunk_geometry(capacity) == expect, capacity
    assert chunk_geometry(10, 3) == (4, 3)
    assert chunk_geometry(9, 3) == (3, 3)
    assert chunk_geometry(0, 4) == (0, 4)


@given(st.integers(1, 1 << 22))
def test_chunk_geometry_covers_capacity_with_fewest_balanced_chunks(capacity):
    nc, ch = chunk_geometry(capacity)
    assert ch <= MAX_CHUNK and nc * ch >= capacity
    assert nc == math.ceil(capacity / MAX_CHUNK)  # fewest chunks
    assert (nc - 1) * ch < capacity  # no empty chunk; balanced: ch = ceil(capacity / nc)
    assert ch == math.ceil(capacity / nc)


def test_index_bytes_and_properties():
    idx = _index(B=2, Hkv=3, NC=2, L=4, CH=5, K=2, OPEN=6, D=8)
    ids = 2 * 3 * 2 * 4 * 5 * 2
    offsets = 2 * 3 * 2 * 4 * 5 * 2
    open_codes = 2 * 3 * 4 * 6 * 2
    bounds = 2 * 3 * 4
    assert index_nbytes(idx) == ids + offsets + open_codes + bounds
    assert index_nbytes(idx, include_mean=True) == ids + offsets + open_codes + bounds + 2 * 3 * 8 * 4 + 8 * 8 * 4
    assert idx.capacity == 10 and idx.open_capacity == 6
    assert type(idx.capacity) is int and type(idx.open_capacity) is int and type(index_nbytes(idx)) is int
    idx = dataclasses.replace(idx, bounds=jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32))
    np.testing.assert_array_equal(idx.start, [0, 3])
    np.testing.assert_array_equal(idx.end, [1, 4])
    idx.bounds = jnp.asarray([[1, 4, 3], [2, 9, 5]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(idx.start), [1, 2])
    np.testing.assert_array_equal(np.asarray(idx.end), [4, 9])


# -- log_u -------------------------------------------------------------------------------------


def test_table_size_at_an_exact_power_of_two():
    # need = 128 K L^(1/K): exactly 2^14 at K = 1, L = 128 (not grown), 2^14 + 128 at L = 129 (grown)
    assert table_size(1, 128) == LOG_U_TABLE_SIZE == 1 << 14
    assert table_size(1, 129) == 1 << 15
    assert table_size(2, 4096) == 1 << 14  # 128 * 2 * 64 = 16384
    assert table_size(1, 256) == 1 << 15  # 32768 exactly
    assert table_size(2, 4225) == 1 << 15  # 128 * 2 * 65 = 16640


def _scipy_log_u_of_p(p: np.ndarray, K: int, L: int) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.log(stats.binom.sf(1, L, p.astype(np.float64) ** K))


@pytest.mark.parametrize(("K", "L"), [(1, 2), (2, 3), (3, 7), (10, 150), (1, 1000), (16, 4096)])
def test_log_u_table_is_log_u_over_p_to_2k(K, L):
    # f(p) = log(u / p^(2K)) on p = i / T; f(0) is the limit log C(L, 2)
    T = 256
    f = log_u_table(K, L, T)
    assert f.shape == (T + 1,) and f.dtype == np.float64
    p = np.arange(1, T + 1, dtype=np.float64) / T
    ref = _scipy_log_u_of_p(p, K, L) - 2 * K * np.log(p)
    ok = np.isfinite(ref) & (_scipy_log_u_of_p(p, K, L) > -700)
    np.testing.assert_allclose(f[1:][ok], ref[ok], rtol=1e-9, atol=1e-9)
    assert f[0] == pytest.approx(math.log(L * (L - 1) / 2), rel=1e-12)
    assert f[-1] == 0.0  # u = 1 at p = 1


@pytest.mark.parametrize(("K", "L"), [(1, 2), (3, 7), (10, 150), (4, 1000)])
def test_log_u_exact_against_scipy(K, L):
    # cosines where L p^K crosses the series threshold 0.05, and the ends
    cos = np.concatenate([[-1.0, 1.0, 1.5, -1.5], np.linspace(-1.0, 1.0, 4001)])
    got = log_u_exact(cos, K, L)
    p = 1.0 - np.arccos(np.clip(cos, -1, 1)) / math.pi
    ref = np.maximum(_scipy_log_u_of_p(p, K, L), LOG_U_FLOOR)
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-12)
    assert got[0] == LOG_U_FLOOR and got[1] == 0.0 and got[2] == 0.0 and got[3] == LOG_U_FLOOR


def test_log_u_exact_clips_cosines_without_invalid_values():
    # |cos| > 1 is clipped before arccos: no NaN is made and no warning raised on the way
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = log_u_exact(np.array([-1.5, -1.0, 1.0, 1.5]), 3, 7)
    np.testing.assert_array_equal(got, [LOG_U_FLOOR, LOG_U_FLOOR, 0.0, 0.0])


def test_host_log_u_defaults_dtypes_vmap_and_message():
    cos = np.linspace(-1.0, 1.0, 33)
    ref = log_u_exact(cos.astype(np.float32), 3, 7)
    got = np.asarray(host_log_u(cos.astype(np.float32), 3, 7))  # the default impl
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5)
    with jax.enable_x64(True):  # float64 cosines are read as float32
        got64 = host_log_u(jnp.asarray(cos, jnp.float64), 3, 7)
        assert got64.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got64), got)
    batched = jax.vmap(lambda c: host_log_u(c, 3, 7))(jnp.asarray(cos.reshape(3, 11), jnp.float32))
    np.testing.assert_allclose(np.asarray(batched).ravel(), ref, rtol=0, atol=2e-5)
    with pytest.raises(ValueError, match=_exact("K must be in [1, 16] for the host op, got K=17")):
        host_log_u(jnp.zeros(3), 17, 7)


@pytest.mark.parametrize("x64", [False, True])
def test_hashed_mean_of_one_key_and_float32_under_x64(x64):
    # row 0 hashes one key ([1, 2)), row 1 seven ([1, 8)); the mean is the float64 mean of the range
    cfg = MagicPIGConfig(K=2, L=3, num_sink=1, num_local=1)
    rng = np.random.default_rng(5)
    k = rng.normal(size=(2, 2, 9, 4)).astype(np.float32) + 3.0
    proj = rng.normal(size=(4, 6)).astype(np.float32)
    lengths = np.array([3, 9], np.int32)
    with jax.enable_x64(x64):
        start, end, mean = hashed_mean(jnp.asarray(k), cfg, jnp.asarray(lengths))
        ref = build_lsh_index(jnp.asarray(k), jnp.asarray(proj), cfg, jnp.asarray(lengths))
        assert mean.dtype == jnp.float32
        expect = np.stack([k[0, :, 1:2].astype(np.float64).mean(1), k[1, :, 1:8].astype(np.float64).mean(1)])
        np.testing.assert_allclose(np.asarray(mean), expect, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(mean), np.asarray(ref.mean))
        np.testing.assert_array_equal(np.asarray(start), [1, 1])
        np.testing.assert_array_equal(np.asarray(end), [2, 8])
        # the host build hashes k - mean with the reference's codes
        hidx = host.host_build_index(jnp.asarray(k), jnp.asarray(proj), cfg, jnp.asarray(lengths))
        np.testing.assert_array_equal(np.asarray(hidx.mean), np.asarray(ref.mean))
        np.testing.assert_array_equal(np.asarray(host.host_key_codes(hidx, jnp.asarray(k))), np.asarray(ref.codes))


# -- quest / topk (pure JAX) ---------------------------------------------------------------------


def _np_page_bounds(k: np.ndarray, start, end, page: int, P: int):
    """float64 NumPy: per-page min/max of the keys [start, end) of each row, +-inf past the range."""
    B, Hkv, _, D = k.shape
    kmin = np.full((B, Hkv, P, D), np.inf)
    kmax = np.full((B, Hkv, P, D), -np.inf)
    for b in range(B):
        for j in range(P):
            lo, hi = start[b] + j * page, min(end[b], start[b] + (j + 1) * page)
            if lo < hi:
                kmin[b, :, j] = k[b, :, lo:hi].min(axis=1)
                kmax[b, :, j] = k[b, :, lo:hi].max(axis=1)
    return kmin, kmax


def test_quest_append_clips_traced_counts_to_zero_and_max_count_and_refuses_concrete_ones():
    rng = np.random.default_rng(3)
    k = rng.normal(size=(3, 2, 40, 5)).astype(np.float32)
    start, end = np.array([2, 0, 5]), np.array([9, 16, 5])
    pages = quest_build_pages(jnp.asarray(k), jnp.asarray(start), jnp.asarray(end), 4, capacity=40)
    assert quest_page_bytes(pages) == 2 * (3 * 2 * 10 * 5 * 4)
    # concrete counts outside [0, max_count] would be changed silently: refused, named
    with pytest.raises(ValueError, match=r"counts must be int \[B\] = \[3\] in \[0, max_count = 6\], got "
                                         r"\[-3, 9, 4\]"):
        quest_append_pages(pages, jnp.asarray(k), jnp.asarray([-3, 9, 4]), 6)
    with pytest.raises(ValueError, match="does not fit the pages, built for B, Hkv, D"):
        quest_append_pages(pages, jnp.asarray(k)[:, :1], jnp.asarray([1, 1, 1]), 6)
    with pytest.raises(ValueError, match="row 1: appending 6 keys at position 16 goes past the cache's 20 positions"):
        quest_append_pages(pages, jnp.asarray(k)[:, :, :20], jnp.asarray([0, 6, 0]), 6)
    # traced (the decoder's): counts -3 (appends nothing), 9 (clipped to max_count 6), 4
    grown = jax.jit(quest_append_pages, static_argnums=3)(pages, jnp.asarray(k), jnp.asarray([-3, 9, 4]), 6)
    new_end = np.array([9, 22, 9])
    np.testing.assert_array_equal(np.asarray(grown.end), new_end)
    np.testing.assert_array_equal(np.asarray(grown.start), start)
    kmin, kmax = _np_page_bounds(k.astype(np.float64), start, new_end, 4, 10)
    np.testing.assert_array_equal(np.asarray(grown.kmin), kmin)
    np.testing.assert_array_equal(np.asarray(grown.kmax), kmax)
    with jax.enable_x64(True):  # int64 counts: the range stays int32
        grown = quest_append_pages(pages, jnp.asarray(k), jnp.asarray([1, 2, 3], jnp.int64), 6)
        assert grown.end.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(grown.end), end + [1, 2, 3])


def test_quest_pages_kept_by_hand():
    n = jnp.asarray([0, 1, 15, 16, 17, 64, 100], jnp.int32)
    # int budget 16, pages of 8: t = min(16, n); all pages when t = n, else max(1, t // 8)
    np.testing.assert_array_equal(np.asarray(quest_pages_kept(16, n, 8)), [0, 1, 2, 2, 2, 2, 2])
    # a fraction: t = ceil(0.25 n)
    np.testing.assert_array_equal(np.asarray(quest_pages_kept(0.25, n, 8)), [0, 1, 1, 1, 1, 2, 3])
    assert quest_pages_kept(0.25, n, 8).dtype == jnp.int32
    # every page of a range of 2^25 keys: ceil(2^25 / 8) in integers (2^25 + 7 is not a float32)
    np.testing.assert_array_equal(np.asarray(quest_pages_kept(1.0, jnp.asarray([1 << 25], jnp.int32), 8)), [1 << 22])
    # and 2^25 - 1 tokens of them keep floor((2^25 - 1) / 8) pages (2^25 - 1 is not a float32 either)
    np.testing.assert_array_equal(np.asarray(quest_pages_kept((1 << 25) - 1, jnp.asarray([1 << 25], jnp.int32), 8)),
                                  [(1 << 22) - 1])


def test_range_bounds_by_hand():
    s, e = range_bounds(3, 10, jnp.asarray([4, 12, 7]), None)
    np.testing.assert_array_equal(np.asarray(s), [0, 0, 0])
    np.testing.assert_array_equal(np.asarray(e), [4, 10, 7])
    assert s.dtype == jnp.int32 and e.dtype == jnp.int32
    s, e = range_bounds(3, 10, jnp.asarray([4, 12, 7]), jnp.asarray([6, -1, 3]))
    np.testing.assert_array_equal(np.asarray(s), [6, 0, 3])
    np.testing.assert_array_equal(np.asarray(e), [6, 10, 7])  # end >= start


# -- attention (the op called directly, and the decode step) ---------------------------------------


def _np_codes(x: np.ndarray, proj: np.ndarray, K: int, L: int) -> np.ndarray:
    """float64 SimHash codes ``[..., L]``: bit j of table l is ``x . proj[:, l*K + j] > 0``."""
    bits = (x @ proj > 0).reshape(*x.shape[:-1], L, K)
    return (bits * (1 << np.arange(K))).sum(-1).astype(np.uint32)


def _np_sampled_attention(q, q_codes, k, v, hidx, lengths, K, L, window, sinks):
    """float64 NumPy of the op's contract: ``(out, lse, num_sampled, mask)``.

    Keys of ``[start, end)`` (and ``< lengths``) whose centered code equals the query's in >= 2
    tables: logit ``q.k/sqrt(D) - max(log u, LOG_U_FLOOR)`` (u: SciPy's binomial tail of
    ``p^K``, ``p = 1 - arccos(cos(q, k - mean))/pi``); keys of ``[end, lengths - window)``
    exact; the sinks ``[0, start)`` exact when ``sinks``.
    """
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    mean = np.asarray(hidx.mean, np.float64)
    proj = np.asarray(hidx.projections, np.float64)
    start, end = np.asarray(hidx.start), np.asarray(hidx.end)
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out, lse = np.zeros((B, Hq, D)), np.full((B, Hq), -np.inf)
    num, mask = np.zeros((B, Hq), np.int64), np.zeros((B, Hq, N), bool)
    for b in range(B):
        n = int(lengths[b])
        for h in range(Hq):
            kh, vh = k[b, h // G], v[b, h // G]
            kc = kh - mean[b, h // G]
            logits = kh @ q[b, h] / math.sqrt(D)
            hits = (_np_codes(kc, proj, K, L) == np.asarray(q_codes)[b, h]).sum(-1)
            pos = np.arange(N)
            sampled = (pos >= start[b]) & (pos < end[b]) & (pos < n) & (hits >= 2)
            cos = kc @ q[b, h] / (np.linalg.norm(kc, axis=-1) * np.linalg.norm(q[b, h]))
            p = 1.0 - np.arccos(np.clip(cos, -1.0, 1.0)) / math.pi
            with np.errstate(divide="ignore"):
                log_u = np.maximum(np.log(stats.binom.sf(1, L, p**K)), LOG_U_FLOOR)
            exact = (pos >= end[b]) & (pos < n - window)
            if sinks:
                exact |= pos < start[b]
            keep = sampled | exact
            if keep.any():
                x = np.where(sampled, logits - log_u, logits)[keep]
                m = x.max()
                e = np.exp(x - m)
                out[b, h] = e @ vh[keep] / e.sum()
                lse[b, h] = m + math.log(e.sum())
            num[b, h], mask[b, h] = sampled.sum(), sampled
    return out, lse, num, mask


def _sampled_case():
    # two rows (lengths 40 and 29 of N = 40), GQA 4 / 2, K = 2, L = 6: most hashed keys collide in 2 tables
    cfg = MagicPIGConfig(K=2, L=6, num_sink=3, num_local=4)
    rng = np.random.default_rng(11)
    q = rng.normal(size=(2, 4, 8)).astype(np.float32)
    k = (rng.normal(size=(2, 2, 40, 8)) + 0.5).astype(np.float32)
    v = rng.normal(size=(2, 2, 40, 8)).astype(np.float32)
    proj = rng.normal(size=(8, 12)).astype(np.float32)
    build_lengths = np.array([33, 22], np.int32)  # keys appended after the build: [end, lengths) is unhashed
    hidx = host.host_build_index(jnp.asarray(k), jnp.asarray(proj), cfg, jnp.asarray(build_lengths), chunk_size=16)
    q_codes = _np_codes(q.astype(np.float64), np.asarray(hidx.projections, np.float64), 2, 6)
    return cfg, q, q_codes, k, v, hidx, np.array([40, 29], np.int32)


def _assert_matches(got, ref, tol=2e-5):
    out, lse, ns = (np.asarray(x) for x in got[:3])
    assert out.dtype == np.float32 and lse.dtype == np.float32 and ns.dtype == np.int32
    np.testing.assert_array_equal(ns, ref[2])
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref[1]))
    fin = np.isfinite(ref[1])
    np.testing.assert_allclose(lse[fin], ref[1][fin], rtol=0, atol=tol)
    np.testing.assert_allclose(out, ref[0], rtol=0, atol=tol)


@pytest.mark.parametrize(("window", "sinks"), [(0, False), (5, False), (0, True), (5, True), (2**31 - 1, True)])
def test_host_sampled_attention_direct_against_float64(window, sinks):
    cfg, q, q_codes, k, v, hidx, lengths = _sampled_case()
    ref = _np_sampled_attention(q, q_codes, k, v, hidx, lengths, 2, 6, window, sinks)
    assert ref[2].sum() > 10 and (ref[2] < np.asarray(hidx.end - hidx.start)[:, None]).any()
    got = host.host_sampled_attention(jnp.asarray(q), jnp.asarray(q_codes), jnp.asarray(k), jnp.asarray(v), hidx,
                                      jnp.asarray(lengths), window=window, sinks=sinks, return_mask=True)
    assert len(got) == 4 and got[3].dtype == jnp.bool_
    np.testing.assert_array_equal(np.asarray(got[3]), ref[3])
    _assert_matches(got, ref)


def test_host_sampled_attention_defaults_x64_and_vmap():
    cfg, q, q_codes, k, v, hidx, lengths = _sampled_case()
    ref = _np_sampled_attention(q, q_codes, k, v, hidx, lengths, 2, 6, 0, False)
    args = (jnp.asarray(q_codes), jnp.asarray(k), jnp.asarray(v), hidx)
    got = host.host_sampled_attention(jnp.asarray(q), *args, jnp.asarray(lengths))  # window 0, no sinks, no mask
    assert len(got) == 3
    _assert_matches(got, ref)
    with jax.enable_x64(True):  # a float64 query and int64 lengths are given to the op as float32 and int32
        got64 = host.host_sampled_attention(jnp.asarray(q, jnp.float64), *args, jnp.asarray(lengths, jnp.int64))
        _assert_matches(got64, ref)
    # vmapped over a stack of two queries (the op runs once per query, sequentially)
    q2 = np.stack([q, q[:, ::-1]])
    c2 = np.stack([q_codes, q_codes[:, ::-1]])
    fn = jax.vmap(lambda qq, cc: host.host_sampled_attention(qq, cc, *args[1:], jnp.asarray(lengths)))
    got2 = fn(jnp.asarray(q2), jnp.asarray(c2))
    for i in range(2):
        _assert_matches([x[i] for x in got2],
                        _np_sampled_attention(q2[i], c2[i], k, v, hidx, lengths, 2, 6, 0, False))


def test_host_sampled_attention_argument_messages():
    cfg, q, q_codes, k, v, hidx, lengths = _sampled_case()
    q, q_codes, k, v, lengths = (jnp.asarray(x) for x in (q, q_codes, k, v, lengths))

    def call(**kw):
        args = dict(q=q, q_codes=q_codes, k=k, v=v, index=hidx, lengths=lengths)
        args.update(kw)
        return host.host_sampled_attention(**args)

    for window in (-1, 2**31):
        with pytest.raises(ValueError, match=_exact(f"window must be in [0, 2147483647], got window={window}")):
            call(window=window)
    with pytest.raises(TypeError, match=_exact("window must be an int, got bool True")):
        call(window=True)
    for t in (-1, 4097):
        with pytest.raises(ValueError, match=_exact(f"max_threads must be in [0, 4096], got max_threads={t}")):
            call(max_threads=t)
    ref = _np_sampled_attention(q, q_codes, k, v, hidx, lengths, 2, 6, 62, False)
    _assert_matches(call(window=62, max_threads=4096), ref)  # the bounds are inclusive
    _assert_matches(call(max_threads=1), _np_sampled_attention(q, q_codes, k, v, hidx, lengths, 2, 6, 0, False))
    with pytest.raises(ValueError, match=_exact("q_codes must be uint32 [B, Hq, L] = [2, 4, 6], got int32 [2, 4, 6]")):
        call(q_codes=q_codes.astype(jnp.int32))
    with pytest.raises(ValueError, match=_exact("q_codes must be uint32 [B, Hq, L] = [2, 4, 6], got uint32 [2, 4, 5]")):
        call(q_codes=q_codes[:, :, :5])
    with pytest.raises(TypeError, match="k and v must both be float32 or both bfloat16"):
        call(v=v.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="impl must be one of"):
        call(impl="avx512")


def test_host_magicpig_attention_static_window_bounds_and_messages():
    cfg, q, q_codes, k, v, hidx, lengths = _sampled_case()
    q, k, v, lengths = (jnp.asarray(x) for x in (q, k, v, lengths))
    for w in (-1, 2**31):
        message = f"static_window must be in [0, 2147483647], got static_window={w}"
        with pytest.raises(ValueError, match=_exact(message)):
            host.host_magicpig_attention(q, k, v, hidx, cfg, lengths, static_window=w)
    with pytest.raises(TypeError, match=_exact("static_window must be an int, got float 4.0")):
        host.host_magicpig_attention(q, k, v, hidx, cfg, lengths, static_window=4.0)
    # every static_window in the bounds gives the estimator: the sinks, the unhashed tail and the sampled keys
    ref = _np_sampled_attention(q, q_codes, k, v, hidx, lengths, 2, 6, 0, True)
    for w in (None, 0, 1, 5, 62, 2**31 - 1):
        got = host.host_magicpig_attention(q, k, v, hidx, cfg, lengths, static_window=w, return_mask=True)
        np.testing.assert_array_equal(np.asarray(got[3]), ref[3])
        _assert_matches(got, ref)


# -- exact -----------------------------------------------------------------------------------------


def _np_dense(q, k, v, lengths):
    """float64 NumPy exact attention over the first ``lengths[b]`` keys: ``(out, lse)``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out, lse = np.zeros((B, Hq, D)), np.full((B, Hq), -np.inf)
    for b in range(B):
        for h in range(Hq):
            n = int(lengths[b])
            if n:
                x = k[b, h // G, :n] @ q[b, h] / math.sqrt(D)
                m = x.max()
                e = np.exp(x - m)
                out[b, h], lse[b, h] = e @ v[b, h // G, :n] / e.sum(), m + math.log(e.sum())
    return out, lse


def _assert_attention(got, ref, tol=2e-5):
    out, lse = (np.asarray(x) for x in got)
    assert out.dtype == np.float32 and lse.dtype == np.float32
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref[1]))
    fin = np.isfinite(ref[1])
    np.testing.assert_allclose(lse[fin], ref[1][fin], rtol=0, atol=tol)
    np.testing.assert_allclose(out, ref[0], rtol=0, atol=tol)


def test_host_exact_attention_group_bound_threads_x64_and_vmap():
    rng = np.random.default_rng(7)
    N, D = 12, 8
    k = rng.normal(size=(1, 1, N, D)).astype(np.float32)
    v = rng.normal(size=(1, 1, N, D)).astype(np.float32)
    # G = 64 (MAX_GROUP) is accepted, G = 65 refused with its message
    q64 = rng.normal(size=(1, 64, D)).astype(np.float32)
    _assert_attention(host.host_exact_attention(jnp.asarray(q64), jnp.asarray(k), jnp.asarray(v)),
                      _np_dense(q64, k, v, [N]))
    q65 = jnp.zeros((1, 65, D), jnp.float32)
    with pytest.raises(ValueError, match=_exact("G = Hq / Hkv must be <= 64, got 65")):
        host.host_exact_attention(q65, jnp.asarray(k), jnp.asarray(v))
    q = rng.normal(size=(2, 4, D)).astype(np.float32)
    k2 = rng.normal(size=(2, 2, N, D)).astype(np.float32)
    v2 = rng.normal(size=(2, 2, N, D)).astype(np.float32)
    args = (jnp.asarray(k2), jnp.asarray(v2))
    lengths = np.array([5, 0], np.int32)
    ref = _np_dense(q, k2, v2, lengths)
    for t in (-1, 1.5):
        with pytest.raises(ValueError, match=_exact(f"max_threads must be an int >= 0, got {t!r}")):
            host.host_exact_attention(jnp.asarray(q), *args, jnp.asarray(lengths), max_threads=t)
    for t in (0, 1):
        _assert_attention(host.host_exact_attention(jnp.asarray(q), *args, jnp.asarray(lengths), max_threads=t), ref)
    _assert_attention(host.host_exact_attention(jnp.asarray(q), *args), _np_dense(q, k2, v2, [N, N]))
    with jax.enable_x64(True):  # float64 q and int64 lengths reach the op as float32 and int32
        got = host.host_exact_attention(jnp.asarray(q, jnp.float64), *args, jnp.asarray(lengths, jnp.int64))
        _assert_attention(got, ref)
    qs = np.stack([q, -q])
    got = jax.vmap(lambda qq: host.host_exact_attention(qq, *args, jnp.asarray(lengths)))(jnp.asarray(qs))
    for i in range(2):
        _assert_attention([x[i] for x in got], _np_dense(qs[i], k2, v2, lengths))


# -- topk ------------------------------------------------------------------------------------------


def _np_topk(q, k, v, budget, lengths, start=None, context=None):
    """float64 NumPy TopK over ``[start, lengths)`` (+ ``[0, start)`` and ``[lengths, context)`` exactly)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, D = q.shape
    N, G = k.shape[2], Hq // k.shape[1]
    out, lse = np.zeros((B, Hq, D)), np.full((B, Hq), -np.inf)
    for b in range(B):
        s = 0 if start is None else min(max(int(start[b]), 0), N)
        e = max(min(max(int(lengths[b]), 0), N), s)
        n = e - s
        t = min(budget if isinstance(budget, int) else math.ceil(budget * n), n)
        for h in range(Hq):
            x = k[b, h // G] @ q[b, h] / math.sqrt(D)
            order = sorted(range(s, e), key=lambda i: (-x[i], i))
            keep = np.zeros(N, bool)
            keep[order[:t]] = True
            if context is not None:
                keep[:s] = True
                keep[e:min(max(int(context[b]), 0), N)] = True
            if keep.any():
                m = x[keep].max()
                w = np.exp(x[keep] - m)
                out[b, h], lse[b, h] = w @ v[b, h // G][keep] / w.sum(), m + math.log(w.sum())
    return out, lse


def test_host_topk_attention_against_float64_messages_x64_and_vmap():
    rng = np.random.default_rng(8)
    B, Hq, Hkv, N, D = 3, 4, 2, 20, 8
    q = rng.normal(size=(B, Hq, D)).astype(np.float32)
    k = rng.normal(size=(B, Hkv, N, D)).astype(np.float32)
    v = rng.normal(size=(B, Hkv, N, D)).astype(np.float32)
    kv = (jnp.asarray(k), jnp.asarray(v))
    lengths, start, context = np.array([20, 9, 14]), np.array([3, 0, 14]), np.array([20, 12, 17])
    for budget in (3, 0.5):
        _assert_attention(host.host_topk_attention(jnp.asarray(q), *kv, budget, jnp.asarray(lengths)),
                          _np_topk(q, k, v, budget, lengths))
        _assert_attention(host.host_topk_attention(jnp.asarray(q), *kv, budget, jnp.asarray(lengths),
                                                   start=jnp.asarray(start)),
                          _np_topk(q, k, v, budget, lengths, start))
        _assert_attention(host.host_topk_attention(jnp.asarray(q), *kv, budget, jnp.asarray(lengths),
                                                   start=jnp.asarray(start), context=jnp.asarray(context)),
                          _np_topk(q, k, v, budget, lengths, start, context))
    _assert_attention(host.host_topk_attention(jnp.asarray(q), *kv, 4), _np_topk(q, k, v, 4, [N] * B))
    for t in (-1, 4097):
        with pytest.raises(ValueError, match=_exact(f"max_threads must be in [0, 4096], got max_threads={t}")):
            host.host_topk_attention(jnp.asarray(q), *kv, 3, max_threads=t)
    for t in (1, 4096):
        _assert_attention(host.host_topk_attention(jnp.asarray(q), *kv, 3, jnp.asarray(lengths), max_threads=t),
                          _np_topk(q, k, v, 3, lengths))
    with pytest.raises(TypeError, match="budget must be an int"):
        host.host_topk_attention(jnp.asarray(q), *kv, "3")
    # G = 64 is accepted, 65 refused
    k1, v1 = jnp.asarray(k[:1, :1]), jnp.asarray(v[:1, :1])
    q64 = rng.normal(size=(1, 64, D)).astype(np.float32)
    _assert_attention(host.host_topk_attention(jnp.asarray(q64), k1, v1, 5),
                      _np_topk(q64, k[:1, :1], v[:1, :1], 5, [N]))
    with pytest.raises(ValueError, match=_exact("G = Hq / Hkv must be <= 64, got 65")):
        host.host_topk_attention(jnp.zeros((1, 65, D), jnp.float32), k1, v1, 5)
    with jax.enable_x64(True):  # float64 q, int64 bounds: the op is given float32 and int32
        got = host.host_topk_attention(jnp.asarray(q, jnp.float64), *kv, 0.5, jnp.asarray(lengths, jnp.int64),
                                       start=jnp.asarray(start, jnp.int64), context=jnp.asarray(context, jnp.int64))
        _assert_attention(got, _np_topk(q, k, v, 0.5, lengths, start, context))
    qs = np.stack([q, -q])
    got = jax.vmap(lambda qq: host.host_topk_attention(qq, *kv, 3, jnp.asarray(lengths)))(jnp.asarray(qs))
    for i in range(2):
        _assert_attention([x[i] for x in got], _np_topk(qs[i], k, v, 3, lengths))


# -- matvec ----------------------------------------------------------------------------------------


def test_quant_matvec_and_dequantize_rows_shapes_dtypes_messages_x64_and_vmap():
    import gguf

    from magicpig_jax.host.matvec import dequantize_rows
    from tests._gguf_rows import gguf_type, random_rows, reference

    rng = np.random.default_rng(4)
    w = random_rows(rng, "Q4_1", 5, 64)  # 5 rows of 40 bytes
    deq = np.asarray(gguf.quants.dequantize(w, gguf_type("Q4_1")), np.float32)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    ref, bound = reference(x.reshape(6, 64), w, "Q4_1")
    ref, bound = ref.reshape(2, 3, 5), bound.reshape(2, 3, 5)
    for t in (0, 1):
        y = np.asarray(host.quant_matvec(jnp.asarray(x), jnp.asarray(w), "Q4_1", max_threads=t))
        assert y.shape == (2, 3, 5) and y.dtype == np.float32 and np.all(np.abs(y - ref) <= bound)
        got = np.asarray(dequantize_rows(jnp.asarray(w), "Q4_1", max_threads=t))
        assert got.shape == (5, 64)
        np.testing.assert_array_equal(got.view(np.uint32), deq.view(np.uint32))
    y1 = np.asarray(host.quant_matvec(jnp.asarray(x[0, 0]), jnp.asarray(w), "Q4_1"))  # one vector [In]
    assert y1.shape == (5,) and np.all(np.abs(y1 - ref[0, 0]) <= bound[0, 0])
    with jax.enable_x64(True):  # float64 activations are multiplied in float32; the result keeps x's dtype
        y64 = host.quant_matvec(jnp.asarray(x, jnp.float64), jnp.asarray(w), "Q4_1")
        assert y64.dtype == jnp.float64 and np.all(np.abs(np.asarray(y64) - ref) <= bound)
        assert host.quant_matvec(jnp.asarray(x), jnp.asarray(w), "Q4_1").dtype == jnp.float32
    yv = jax.vmap(lambda xx: host.quant_matvec(xx, jnp.asarray(w), "Q4_1"))(jnp.asarray(x))
    assert yv.shape == (2, 3, 5) and np.all(np.abs(np.asarray(yv) - ref) <= bound)
    dv = jax.vmap(lambda ww: dequantize_rows(ww, "Q4_1"))(jnp.asarray(np.stack([w, w[::-1]])))
    np.testing.assert_array_equal(np.asarray(dv), np.stack([deq, deq[::-1]]))
    xj, wj = jnp.asarray(x), jnp.asarray(w)
    for t in (-1, 1.5):
        with pytest.raises(ValueError, match=_exact(f"max_threads must be an int >= 0, got {t!r}")):
            host.quant_matvec(xj, wj, "Q4_1", max_threads=t)
        with pytest.raises(ValueError, match=_exact(f"max_threads must be an int >= 0, got {t!r}")):
            dequantize_rows(wj, "Q4_1", max_threads=t)
    with pytest.raises(ValueError, match=_exact("x must have at least one dimension [..., In], got shape ()")):
        host.quant_matvec(jnp.float32(1.0), wj, "Q4_1")
    with pytest.raises(TypeError, match=_exact("packed must be uint8 GGUF rows, got int8")):
        host.quant_matvec(xj, wj.astype(jnp.int8), "Q4_1")
    with pytest.raises(ValueError, match=_exact("packed must be uint8 [Out, 40] for Q4_1 rows of In=64, got shape "
                                                "(5, 34)")):
        host.quant_matvec(xj, wj[:, :34], "Q4_1")
    with pytest.raises(ValueError, match=_exact("packed must be uint8 [Out, 40] for Q4_1 rows of In=64, got shape "
                                                "(5, 40, 1)")):
        host.quant_matvec(xj, wj[:, :, None], "Q4_1")
    with pytest.raises(ValueError, match=_exact("packed must be uint8 [Out, 40] for Q4_1 rows of In=64, got shape "
                                                "(40,)")):
        host.quant_matvec(xj, wj[0], "Q4_1")
    for bad in (wj[0], wj[:, :, None]):
        with pytest.raises(ValueError, match=_exact(f"packed must be uint8 [R, RB], got shape {bad.shape}")):
            dequantize_rows(bad, "Q4_1")
    with pytest.raises(TypeError, match=_exact("packed must be uint8 GGUF rows, got int8")):
        dequantize_rows(wj.astype(jnp.int8), "Q4_1")


def test_host_magicpig_attention_passes_impl_and_max_threads_to_the_op_on_both_paths():
    # static_window 0 (the op alone) and 5 (the op and the static part): an unknown impl or a thread count out
    # of range reaches the op's checks on either path
    cfg, q, q_codes, k, v, hidx, lengths = _sampled_case()
    q, k, v, lengths = (jnp.asarray(x) for x in (q, k, v, lengths))
    for w in (0, 5):
        with pytest.raises(ValueError, match=_exact("impl must be one of ['auto', 'avx2', 'scalar'], got 'neon'")):
            host.host_magicpig_attention(q, k, v, hidx, cfg, lengths, static_window=w, impl="neon")
        for t in (-1, 4097):
            with pytest.raises(ValueError, match=_exact(f"max_threads must be in [0, 4096], got max_threads={t}")):
                host.host_magicpig_attention(q, k, v, hidx, cfg, lengths, static_window=w, max_threads=t)


# -- quest -----------------------------------------------------------------------------------------


def _np_quest(q, k, v, page, budget, start, end, context=None):
    """float64 NumPy Quest over ``[start, end)`` paged from ``start`` (+ ``[0, start)``, ``[end, context)``
    exactly): each head keeps its ``max(1, t // page)`` best pages by ``sum max(q kmin, q kmax)`` (ties by
    the smaller page), all of them when ``t = min(tokens, n) = n``."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, D = q.shape
    N, G = k.shape[2], Hq // k.shape[1]
    out, lse = np.zeros((B, Hq, D)), np.full((B, Hq), -np.inf)
    for b in range(B):
        s, e = int(start[b]), int(end[b])
        n = e - s
        t = min(budget if isinstance(budget, int) else math.ceil(budget * n), n)
        n_pages = -(-n // page)
        n_keep = n_pages if t >= n else max(1, t // page)
        for h in range(Hq):
            kh = k[b, h // G]
            scores = [np.sum(np.maximum(q[b, h] * kh[s + j * page:min(s + (j + 1) * page, e)].min(0),
                                        q[b, h] * kh[s + j * page:min(s + (j + 1) * page, e)].max(0)))
                      for j in range(n_pages)]
            keep = np.zeros(N, bool)
            for j in sorted(range(n_pages), key=lambda j: (-scores[j], j))[:n_keep]:
                keep[s + j * page:min(s + (j + 1) * page, e)] = True
            if context is not None:
                keep[:s] = True
                keep[e:min(int(context[b]), N)] = True
            if keep.any():
                x = kh @ q[b, h] / math.sqrt(D)
                m = x[keep].max()
                w = np.exp(x[keep] - m)
                out[b, h], lse[b, h] = w @ v[b, h // G][keep] / w.sum(), m + math.log(w.sum())
    return out, lse


def _pages_of(k, start, end, page, P):
    """QuestPages from float64 NumPy bounds (not from quest_build_pages)."""
    kmin, kmax = _np_page_bounds(np.asarray(k, np.float64), start, end, page, P)
    return QuestPages(kmin=jnp.asarray(kmin, jnp.float32), kmax=jnp.asarray(kmax, jnp.float32),
                      start=jnp.asarray(start, jnp.int32), end=jnp.asarray(end, jnp.int32), page_size=page)


def test_host_quest_attention_against_float64_messages_x64_and_vmap():
    rng = np.random.default_rng(9)
    B, Hq, Hkv, N, D, page = 3, 4, 2, 30, 8, 4
    q = rng.normal(size=(B, Hq, D)).astype(np.float32)
    k = rng.normal(size=(B, Hkv, N, D)).astype(np.float32)
    v = rng.normal(size=(B, Hkv, N, D)).astype(np.float32)
    kv = (jnp.asarray(k), jnp.asarray(v))
    start, end, context = np.array([2, 0, 7]), np.array([27, 13, 7]), np.array([30, 20, 9])
    pages = _pages_of(k, start, end, page, 8)
    for budget in (5, 9, 0.5, 1.0):
        _assert_attention(host.host_quest_attention(jnp.asarray(q), *kv, pages, budget),
                          _np_quest(q, k, v, page, budget, start, end))
        _assert_attention(host.host_quest_attention(jnp.asarray(q), *kv, pages, budget, context=jnp.asarray(context)),
                          _np_quest(q, k, v, page, budget, start, end, context))
    ref = _np_quest(q, k, v, page, 9, start, end, context)
    for t in (1, 4096):
        _assert_attention(host.host_quest_attention(jnp.asarray(q), *kv, pages, 9, context=jnp.asarray(context),
                                                    max_threads=t), ref)
    for t in (-1, 4097):
        with pytest.raises(ValueError, match=_exact(f"max_threads must be in [0, 4096], got max_threads={t}")):
            host.host_quest_attention(jnp.asarray(q), *kv, pages, 9, max_threads=t)
    with pytest.raises(ValueError, match="impl must be one of"):
        host.host_quest_attention(jnp.asarray(q), *kv, pages, 9, impl="neon")
    with pytest.raises(TypeError, match="budget must be an int"):
        host.host_quest_attention(jnp.asarray(q), *kv, pages, "9")
    with pytest.raises(TypeError, match=_exact("pages must be a QuestPages, got tuple")):
        host.host_quest_attention(jnp.asarray(q), *kv, (pages.kmin, pages.kmax), 9)
    bad = dataclasses.replace(pages, kmax=pages.kmax[:, :, :7])
    with pytest.raises(ValueError, match=_exact("pages.kmin/kmax must be [B, Hkv, P, D] = [3, 2, P, 8], got "
                                                "(3, 2, 8, 8) and (3, 2, 7, 8)")):
        host.host_quest_attention(jnp.asarray(q), *kv, bad, 9)
    for kmin in (pages.kmin[:2], pages.kmin[:, :1], pages.kmin[..., :7]):
        with pytest.raises(ValueError, match=r"^pages\.kmin/kmax must be \[B, Hkv, P, D\]"):
            host.host_quest_attention(jnp.asarray(q), *kv, dataclasses.replace(pages, kmin=kmin), 9)
    # G = 64 is accepted, 65 refused
    p1 = _pages_of(k[:1, :1], start[:1], end[:1], page, 8)
    q64 = rng.normal(size=(1, 64, D)).astype(np.float32)
    _assert_attention(host.host_quest_attention(jnp.asarray(q64), kv[0][:1, :1], kv[1][:1, :1], p1, 9),
                      _np_quest(q64, k[:1, :1], v[:1, :1], page, 9, start[:1], end[:1]))
    with pytest.raises(ValueError, match=_exact("G = Hq / Hkv must be <= 64, got 65")):
        host.host_quest_attention(jnp.zeros((1, 65, D), jnp.float32), kv[0][:1, :1], kv[1][:1, :1], p1, 9)
    with jax.enable_x64(True):  # float64 q and bounds, int64 range and context: the op gets float32 / int32
        p64 = QuestPages(kmin=pages.kmin.astype(jnp.float64), kmax=pages.kmax.astype(jnp.float64),
                         start=jnp.asarray(start, jnp.int64), end=jnp.asarray(end, jnp.int64), page_size=page)
        _assert_attention(host.host_quest_attention(jnp.asarray(q, jnp.float64), *kv, p64, 9,
                                                    context=jnp.asarray(context, jnp.int64)), ref)
    qs = np.stack([q, -q])
    got = jax.vmap(lambda qq: host.host_quest_attention(qq, *kv, pages, 9))(jnp.asarray(qs))
    for i in range(2):
        _assert_attention([x[i] for x in got], _np_quest(qs[i], k, v, page, 9, start, end))


def test_quest_build_pages_against_float64_bounds_and_messages():
    rng = np.random.default_rng(10)
    k = rng.normal(size=(2, 3, 37, 5)).astype(np.float32)
    start, end = np.array([3, 0]), np.array([37, 20])
    # default page_size 16 and capacity N: P = ceil(37 / 16) = 3
    pages = quest_build_pages(jnp.asarray(k), jnp.asarray(start), jnp.asarray(end))
    assert pages.page_size == 16 and pages.kmin.shape == (2, 3, 3, 5) and pages.kmin.dtype == jnp.float32
    kmin, kmax = _np_page_bounds(k.astype(np.float64), start, end, 16, 3)
    np.testing.assert_array_equal(np.asarray(pages.kmin), kmin)
    np.testing.assert_array_equal(np.asarray(pages.kmax), kmax)
    assert pages.start.dtype == jnp.int32 and pages.end.dtype == jnp.int32
    # page_size 5, capacity 41 (P = 9), an end before its start (empty), bounds past N clipped
    pages = quest_build_pages(jnp.asarray(k), jnp.asarray([4, 50]), jnp.asarray([2, 60]), 5, capacity=41)
    assert pages.kmin.shape == (2, 3, 9, 5)
    np.testing.assert_array_equal(np.asarray(pages.start), [4, 37])
    np.testing.assert_array_equal(np.asarray(pages.end), [4, 37])
    assert np.isposinf(np.asarray(pages.kmin)).all() and np.isneginf(np.asarray(pages.kmax)).all()
    # a capacity below a row's range dropped the pages past it (their keys had no bound)
    with pytest.raises(ValueError, match=_exact("capacity (1) must hold every row's range [start, end); the longest "
                                                "has 34 keys")):
        quest_build_pages(jnp.asarray(k), jnp.asarray(start), jnp.asarray(end), 5, capacity=1)
    assert quest_build_pages(jnp.asarray(k), jnp.asarray(start), jnp.asarray(end), 5, capacity=34).kmin.shape == (
        2, 3, 7, 5)
    for bad in (2.7, True, "34"):
        with pytest.raises(TypeError, match="capacity must be an int"):
            quest_build_pages(jnp.asarray(k), jnp.asarray(start), jnp.asarray(end), 5, capacity=bad)
    with jax.enable_x64(True):  # float64 keys and int64 bounds: float32 bounds, int32 range
        pages = quest_build_pages(jnp.asarray(k, jnp.float64), jnp.asarray(start, jnp.int64),
                                  jnp.asarray(end, jnp.int64), 5)
        assert pages.kmin.dtype == jnp.float32 and pages.start.dtype == jnp.int32 and pages.end.dtype == jnp.int32
        kmin, kmax = _np_page_bounds(k.astype(np.float64), start, end, 5, 8)
        np.testing.assert_array_equal(np.asarray(pages.kmin), kmin)
        np.testing.assert_array_equal(np.asarray(pages.kmax), kmax)
    with pytest.raises(ValueError, match=_exact("capacity must be >= 1, got 0")):
        quest_build_pages(jnp.asarray(k), jnp.asarray(start), jnp.asarray(end), 5, capacity=0)
    with pytest.raises(ValueError, match=_exact("k must be [B, Hkv, N, D], got shape (3, 37, 5)")):
        quest_build_pages(jnp.asarray(k[0]), jnp.asarray(start), jnp.asarray(end), 5)
    with pytest.raises(ValueError, match=_exact("page_size must be in [1, 65536], got page_size=0")):
        quest_build_pages(jnp.asarray(k), jnp.asarray(start), jnp.asarray(end), 0)


def test_quest_append_pages_at_position_0_and_into_the_last_page():
    # row 0: an empty range at 0 grows to [0, 5) (position 0 is read); row 1: [0, 9) grows to [0, 12) = N, into the
    # last page (P = 3) and up to position N - 1; the page size is kept
    rng = np.random.default_rng(12)
    k = rng.normal(size=(2, 2, 12, 3)).astype(np.float32)
    start, end = np.array([0, 0]), np.array([0, 9])
    pages = quest_build_pages(jnp.asarray(k), jnp.asarray(start), jnp.asarray(end), 4, capacity=12)
    grown = quest_append_pages(pages, jnp.asarray(k), jnp.asarray([5, 3]), 5)
    assert grown.page_size == 4 and grown.kmin.shape == (2, 2, 3, 3)
    np.testing.assert_array_equal(np.asarray(grown.end), [5, 12])
    kmin, kmax = _np_page_bounds(k.astype(np.float64), start, np.array([5, 12]), 4, 3)
    np.testing.assert_array_equal(np.asarray(grown.kmin), kmin)
    np.testing.assert_array_equal(np.asarray(grown.kmax), kmax)
    with jax.enable_x64(True), warnings.catch_warnings():
        # float64 keys: the bounds stay float32 and no dtype-promotion warning is raised on the way
        warnings.simplefilter("error")
        grown = quest_append_pages(pages, jnp.asarray(k, jnp.float64), jnp.asarray([5, 3]), 5)
        assert grown.kmin.dtype == jnp.float32 and grown.kmax.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(grown.kmin), kmin)
        np.testing.assert_array_equal(np.asarray(grown.kmax), kmax)


def test_host_quest_attention_ranges_not_at_0_and_both_bounds_of_the_wrong_heads():
    # the pages kept are counted on the range's length end - start (a range starting at 8 keeps 2 of 4 pages at 0.5)
    rng = np.random.default_rng(13)
    B, Hq, Hkv, N, D, page = 2, 2, 2, 30, 8, 4
    q = rng.normal(size=(B, Hq, D)).astype(np.float32)
    k = rng.normal(size=(B, Hkv, N, D)).astype(np.float32)
    v = rng.normal(size=(B, Hkv, N, D)).astype(np.float32)
    kv = (jnp.asarray(k), jnp.asarray(v))
    start, end = np.array([8, 12]), np.array([24, 30])
    pages = _pages_of(k, start, end, page, 5)
    for budget in (0.5, 6):
        _assert_attention(host.host_quest_attention(jnp.asarray(q), *kv, pages, budget),
                          _np_quest(q, k, v, page, budget, start, end))
    # kmin and kmax of the same wrong shape (one KV head): refused by the shape check, not by the op
    one = dataclasses.replace(pages, kmin=pages.kmin[:, :1], kmax=pages.kmax[:, :1])
    with pytest.raises(ValueError, match=_exact("pages.kmin/kmax must be [B, Hkv, P, D] = [2, 2, P, 8], got "
                                                "(2, 1, 5, 8) and (2, 1, 5, 8)")):
        host.host_quest_attention(jnp.asarray(q), *kv, one, 6)


def test_max_threads_refuses_a_bool_in_every_host_op():
    # True is an int to isinstance; like every other op's check_int, these refuse it by name
    # rather than run it as one thread.
    from magicpig_jax.host.matvec import dequantize_rows, packed_row_bytes, quant_matvec

    q, kv = jnp.zeros((1, 2, 8)), jnp.zeros((1, 1, 4, 8))
    packed = jnp.zeros((3, packed_row_bytes("Q8_0", 32)), jnp.uint8)
    calls = {
        "host_exact_attention": lambda t: host.host_exact_attention(q, kv, kv, max_threads=t),
        "quant_matvec": lambda t: quant_matvec(jnp.zeros((32,)), packed, "Q8_0", max_threads=t),
        "dequantize_rows": lambda t: dequantize_rows(packed, "Q8_0", max_threads=t),
    }
    for name, call in calls.items():
        for bad in (True, False, -1, 1.0):
            with pytest.raises(ValueError, match=re.escape(f"max_threads must be an int >= 0, got {bad!r}")):
                call(bad)
        assert np.all(np.isfinite(np.asarray(jax.tree.leaves(call(1))[0]))), name


def test_quest_append_pages_refuses_keys_past_its_pages():
    # pages built for capacity 8 from position 2 (P = 2 pages of 4: positions [2, 10)); row 1
    # has room for 2 more keys, not 3; under jit the caller keeps within the capacity
    k = jnp.asarray(np.random.default_rng(14).normal(size=(2, 1, 16, 3)), jnp.float32)
    pages = quest_build_pages(k, jnp.asarray([2, 2]), jnp.asarray([4, 8]), 4, capacity=8)
    assert pages.kmin.shape[2] == 2
    grown = quest_append_pages(pages, k, jnp.asarray([6, 2]), 6)  # both rows exactly full
    np.testing.assert_array_equal(np.asarray(grown.end), [10, 10])
    with pytest.raises(ValueError, match=re.escape("row 1: appending 3 keys at position 8 exceeds the 2 pages of 4 "
                                                   "positions built from position 2")):
        quest_append_pages(pages, k, jnp.asarray([0, 3]), 6)
