"""The Python side of the host ops (``magicpig_jax.host``) on cases computed by hand: the argument
checks and their exact messages, the index geometry and bytes, the ``log u`` table's size and
its float64 form against SciPy, and the pure-JAX helpers (Quest page bounds, TopK ranges, the
first mean of an append) against float64 NumPy.

Written for the surviving mutants of ``mutmut`` (docs/mutation.md, "host/"): each test fixes a
value or a message that a mutant changed without any other test noticing.
"""

from __future__ import annotations

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
from magicpig_jax.attention.magicpig import LOG_U_FLOOR, build_lsh_index
from magicpig_jax.host import _ext, validate
from magicpig_jax.host import build as host_build
from magicpig_jax.host.build import build_lsh_index_blocked
from magicpig_jax.host.index import DEFAULT_OPEN_CAPACITY, MAX_CHUNK, HostIndex, chunk_geometry, index_nbytes
from magicpig_jax.host.log_u import LOG_U_TABLE_SIZE, host_log_u, log_u_exact, log_u_table, table_size
from magicpig_jax.host.quest import quest_append_pages, quest_build_pages, quest_page_bytes, quest_pages_kept
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


def test_blocked_build_validates_its_arguments_as_build_lsh_index(monkeypatch):
    monkeypatch.setattr(host_build, "CODES_BLOCK_BYTES", 1 << 10)
    cfg = MagicPIGConfig(K=2, L=3, num_sink=1, num_local=1)
    k = jnp.zeros((1, 1, 6, 4), jnp.float32)
    proj = jnp.zeros((4, 6), jnp.float32)
    with pytest.raises(TypeError):
        build_lsh_index_blocked(k, proj, cfg, jnp.asarray([6.0]))


@pytest.mark.parametrize("x64", [False, True])
def test_blocked_build_mean_of_one_key_and_float32_under_x64(x64, monkeypatch):
    monkeypatch.setattr(host_build, "CODES_BLOCK_BYTES", 2 * 2 * 6 * 4 * 4)  # blocks of 4 positions (3 blocks)
    # row 0 hashes one key ([1, 2)), row 1 seven ([1, 8)); the mean is the float64 mean of the range
    cfg = MagicPIGConfig(K=2, L=3, num_sink=1, num_local=1)
    rng = np.random.default_rng(5)
    k = rng.normal(size=(2, 2, 9, 4)).astype(np.float32) + 3.0
    proj = rng.normal(size=(4, 6)).astype(np.float32)
    lengths = np.array([3, 9], np.int32)
    with jax.enable_x64(x64):
        got = build_lsh_index_blocked(jnp.asarray(k), jnp.asarray(proj), cfg, jnp.asarray(lengths))
        ref = build_lsh_index(jnp.asarray(k), jnp.asarray(proj), cfg, jnp.asarray(lengths))
        assert got.mean.dtype == jnp.float32 and got.codes.dtype == jnp.uint32
        expect = np.stack([k[0, :, 1:2].astype(np.float64).mean(1), k[1, :, 1:8].astype(np.float64).mean(1)])
        np.testing.assert_allclose(np.asarray(got.mean), expect, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(got.codes), np.asarray(ref.codes))
        np.testing.assert_array_equal(np.asarray(got.start), [1, 1])
        np.testing.assert_array_equal(np.asarray(got.end), [2, 8])


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


def test_quest_append_clips_counts_to_zero_and_max_count():
    rng = np.random.default_rng(3)
    k = rng.normal(size=(3, 2, 40, 5)).astype(np.float32)
    start, end = np.array([2, 0, 5]), np.array([9, 16, 5])
    pages = quest_build_pages(jnp.asarray(k), jnp.asarray(start), jnp.asarray(end), 4, capacity=40)
    assert quest_page_bytes(pages) == 2 * (3 * 2 * 10 * 5 * 4)
    # counts -3 (appends nothing), 9 (clipped to max_count 6), 4
    grown = quest_append_pages(pages, jnp.asarray(k), jnp.asarray([-3, 9, 4]), 6)
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
