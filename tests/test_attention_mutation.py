"""Tests written against mutmut's surviving mutants of ``magicpig_jax/attention/`` (issue 18,
docs/mutation.md): each asserts values against an independent reference (float64 NumPy or
SciPy, or a case computed by hand) or an exact error message, where the older tests were too
loose to notice the mutant."""

from __future__ import annotations

import inspect
import json
import re

import _np_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from magicpig_jax import lsh
from magicpig_jax.attention import (
    HybridConfig,
    LayerConfigs,
    MagicPIGConfig,
    budget_tokens,
    build_lsh_index,
    cost_model,
    dense_attention,
    magicpig_attention,
    merge_attention,
    static_attention,
)
from magicpig_jax.attention.layer_configs import FORMAT

pytestmark = pytest.mark.usefixtures("strict_jax")

from tests._jitted import i32, make_qkv  # noqa: E402
from tests._messages import message, without_jaxtyping  # noqa: E402

# --- magicpig --------------------------------------------------------------------------------


def test_magicpig_messages():
    cfg = MagicPIGConfig(K=4, L=10)
    q, k, v = make_qkv(9, N=30)
    proj = lsh.simhash_projections(jax.random.key(0), 16, 4, 10)
    index = build_lsh_index(k, proj, cfg)
    assert message(ValueError, magicpig_attention, q, k, v, index, MagicPIGConfig(K=4, L=12)) == (
        "the index was built with L=10 tables (index.codes (2, 2, 30, 10)) but config has L=12: "
        "build the index with this config"
    )
    assert message(ValueError, magicpig_attention, q, k, v, index, MagicPIGConfig(K=5, L=10)) == (
        "the index was built with K=4 bits per table (index.projections (16, 40)) but config has K=5: "
        "build the index with this config"
    )
    # other shapes that do not fit: the general messages
    assert message(ValueError, magicpig_attention, q[:1], k[:1], v[:1], index, cfg) == (
        "index.codes must be [B, Hkv, N, L] = (1, 2, 30, 10), got (2, 2, 30, 10)"
    )
    q8, k8, v8 = make_qkv(9, N=30, D=8)
    assert message(ValueError, magicpig_attention, q8, k8, v8, index, cfg) == (
        "index.projections must be [D, K*L] = (8, 40), got (16, 40)"
    )
    assert message(ValueError, build_lsh_index, k, proj[:, :-1], cfg) == (
        "projections must be [D, K*L] = [16, 40] for K=4, L=10, got (16, 39)"
    )
    with without_jaxtyping():
        assert message(ValueError, build_lsh_index, k[0], proj, cfg) == (
            "k must be [B, Hkv, N, D], got shape (2, 30, 16)"
        )
        assert message(TypeError, build_lsh_index, k, proj, {"K": 4}) == "config must be a MagicPIGConfig, got dict"
        assert message(TypeError, build_lsh_index, k, proj, cfg, center=1) == "center must be a bool, got int 1"


def test_magicpig_under_x64_keeps_its_dtypes_and_matches_float64():
    K, L, num_sink, num_local, N = 4, 10, 2, 3, 40
    cfg = MagicPIGConfig(K=K, L=L, num_sink=num_sink, num_local=num_local)
    with jax.enable_x64(True):
        q, k, v = make_qkv(54, B=3, N=N, scale=1.5, cone=4.0)
        build, lengths = i32([N - 5, N, 6]), i32([N, N, 5])
        proj = lsh.simhash_projections(jax.random.key(K), 16, K, L)
        index = build_lsh_index(k, proj, cfg, build)
        out, lse, num = magicpig_attention(q, k, v, index, cfg, lengths)
        qcodes = np.asarray(lsh.simhash_codes(q, proj, K, L))
    assert (index.codes.dtype, index.mean.dtype, index.start.dtype, index.end.dtype) == (
        np.uint32, np.float32, np.int32, np.int32
    )
    assert (out.dtype, lse.dtype, num.dtype) == (np.float32, np.float32, np.int32)
    r_out, r_lse, r_num = ref.magicpig(
        q, k, v, np.asarray(index.codes), qcodes, K, L, num_sink, num_local, np.asarray(build), np.asarray(lengths)
    )
    assert 0 < r_num.sum() < 3 * N * 4
    np.testing.assert_array_equal(num, r_num)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", [0.05, 0.2])
def test_magicpig_small_norms_match_float64(scale):
    # |q| |k - mean| < 1 for most keys: the cosine must still be q.k / (|q| |k|), not the bare dot
    K, L, N = 3, 12, 48
    cfg = MagicPIGConfig(K=K, L=L, num_sink=1, num_local=2)
    q, k, v = make_qkv(77, B=2, N=N, scale=scale)
    proj = lsh.simhash_projections(jax.random.key(3), 16, K, L)
    index = build_lsh_index(k, proj, cfg)
    out, lse, num = magicpig_attention(q, k, v, index, cfg)
    kc = np.asarray(k, np.float64) - np.asarray(index.mean, np.float64)[:, :, None, :]
    assert np.mean(np.linalg.norm(kc, axis=-1)[..., None, :] * np.linalg.norm(q, axis=-1)[:, None, :, None]) < 1
    qcodes = np.asarray(lsh.simhash_codes(q, proj, K, L))
    r_out, r_lse, r_num = ref.magicpig(q, k, v, np.asarray(index.codes), qcodes, K, L, 1, 2, [N, N], [N, N])
    assert 0 < r_num.sum() < 2 * 4 * N
    np.testing.assert_array_equal(num, r_num)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-5)


# --- _common (through dense_attention) and config ---------------------------------------------


def test_shape_dtype_and_config_messages():
    q, k, v = make_qkv(4)
    cases = [
        ((q[0], k, v), ValueError, "q must be [B, Hq, D], got shape (4, 16)"),
        ((q, k[0], v[0]), ValueError, "k and v must be [B, Hkv, N, D], got k (2, 24, 16), v (2, 24, 16)"),
        ((q, k, v[0]), ValueError, "k and v must be [B, Hkv, N, D], got k (2, 2, 24, 16), v (2, 24, 16)"),
        ((q, k, v[:, :, :5]), ValueError, "k and v must have the same shape, got (2, 2, 24, 16) and (2, 2, 5, 16)"),
        ((q[:1], k, v), ValueError, "q (1, 4, 16) and k (2, 2, 24, 16) disagree on B or D"),
        ((q[..., :8], k, v), ValueError, "q (2, 4, 8) and k (2, 2, 24, 16) disagree on B or D"),
        ((q[:, :3], k, v), ValueError, "Hq (3) must be a multiple of Hkv (2) for GQA"),
        ((q, k[:, :0], v[:, :0]), ValueError, "Hq (4) must be a multiple of Hkv (0) for GQA"),
        ((q.astype(jnp.int32), k, v), TypeError, "q must be a floating dtype, got int32"),
        ((q, k.astype(jnp.int32), v), TypeError, "k must be a floating dtype, got int32"),
        ((q, k, v.astype(jnp.int32)), TypeError, "v must be a floating dtype, got int32"),
        ((q, k, v, i32([1, 2, 3])), ValueError, "lengths must be [B] = [2], got shape (3,)"),
        ((q, k, v, jnp.array([1.0, 2.0])), TypeError, "lengths must be an integer array, got float32"),
    ]
    with without_jaxtyping():
        for args, exc, want in cases:
            assert message(exc, dense_attention, *args) == want
    configs = [
        ({"K": 0}, ValueError, "K must be in [1, 32] (bits per uint32 code), got K=0"),
        ({"L": 1}, ValueError, "L must be >= 2 (sampling needs >= 2 colliding tables), got L=1"),
        ({"num_sink": -1}, ValueError, "num_sink must be >= 0, got num_sink=-1"),
        ({"num_sink": 1.5}, TypeError, "num_sink must be an int, got float 1.5"),
        ({"num_local": -2}, ValueError, "num_local must be >= 0, got num_local=-2"),
        # past int32 positions: refused here, not an OverflowError after the prefill
        ({"num_local": 2**29 + 1}, ValueError, f"num_local must be <= 2**29 (positions are int32), got "
                                               f"num_local={2**29 + 1}"),
        ({"num_sink": 2**31}, ValueError, f"num_sink must be <= 2**29 (positions are int32), got num_sink={2**31}"),
        ({"num_local": None}, TypeError, "num_local must be an int, got NoneType None"),
        ({"num_local": True}, TypeError, "num_local must be an int, got bool True"),
        ({"seed": -1}, ValueError, "seed must be >= 0, got seed=-1"),
        ({"seed": "0"}, TypeError, "seed must be an int, got str '0'"),
    ]
    with without_jaxtyping():
        for kwargs, exc, want in configs:
            assert message(exc, MagicPIGConfig, **kwargs) == want
    # the static window: the local window and two generation buffers (by hand)
    assert MagicPIGConfig(num_local=64).static_window() == 64 + 2 * 256
    assert MagicPIGConfig(num_local=5).static_window(10) == 25
    assert MagicPIGConfig(num_local=0).static_window(0) == 0
    # the hashed range [min(num_sink, n), max(n - num_local, start)), by hand
    start, end = MagicPIGConfig(num_sink=3, num_local=4).hashed_range(i32([0, 2, 3, 6, 7, 8, 20]))
    assert (start.dtype, end.dtype) == (np.int32, np.int32)
    np.testing.assert_array_equal(start, [0, 2, 3, 3, 3, 3, 3])
    np.testing.assert_array_equal(end, [0, 2, 3, 3, 3, 4, 16])
    # the boundaries are accepted
    assert MagicPIGConfig(num_sink=0, num_local=0, seed=0) == MagicPIGConfig(num_sink=0, num_local=0)


# --- static --------------------------------------------------------------------------------


def _assert_static_is_the_float64_selection(q, k, v, out, lse, start, end, lengths, num_sink, window):
    """static_attention's result equals float64 attention over the sinks and the (windowed) tail."""
    (B, Hq, _), N = q.shape, k.shape[2]
    pos = np.arange(N)
    keep = np.zeros((B, Hq, N), bool)
    for b in range(B):
        tail_from = end[b] if window is None else max(end[b], lengths[b] - window)
        keep[b] = (pos < min(start[b], num_sink)) | ((pos >= tail_from) & (pos < lengths[b]))
    r_out, r_lse = ref.selected(q, k, v, keep)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-5)


@settings(max_examples=20)
@given(data=st.data(), N=st.integers(1, 12), Hkv=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_static_attention_matches_float64(data, N, Hkv, seed):
    B, Hq = 2, 2 * Hkv
    lengths = np.asarray(data.draw(st.lists(st.integers(0, N), min_size=B, max_size=B)))
    start = np.asarray([data.draw(st.integers(0, n)) for n in lengths])
    end = np.asarray([data.draw(st.integers(s, n)) for s, n in zip(start, lengths, strict=True)])
    num_sink = data.draw(st.integers(0, N + 2))
    window = data.draw(st.one_of(st.none(), st.integers(0, N + 2)))
    q, k, v = make_qkv(seed, B=B, Hq=Hq, Hkv=Hkv, N=N, D=4, scale=2.0)
    out, lse = static_attention(q, k, v, i32(start), i32(end), i32(lengths), num_sink=num_sink, window=window)
    _assert_static_is_the_float64_selection(q, k, v, out, lse, start, end, lengths, num_sink, window)


@settings(max_examples=20)
@given(data=st.data(), N=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_static_attention_clips_out_of_range_positions_the_same_way_on_both_paths(data, N, seed):
    """start > end, lengths > N or negative positions (a traced caller cannot be refused): the
    masked path and the windowed path (W = N reads every position) gave different answers
    (sinks counted twice, a tail past N); both now equal float64 over the clipped selection."""
    B = 2
    draw = lambda lo, hi: np.asarray(data.draw(st.lists(st.integers(lo, hi), min_size=B, max_size=B)))  # noqa: E731
    lengths, start, end = draw(-2, N + 4), draw(-2, N + 4), draw(-2, N + 4)
    num_sink = data.draw(st.integers(0, N + 2))
    q, k, v = make_qkv(seed, B=B, Hq=2, Hkv=1, N=N, D=4, scale=2.0)
    masked = static_attention(q, k, v, i32(start), i32(end), i32(lengths), num_sink=num_sink)
    windowed = static_attention(q, k, v, i32(start), i32(end), i32(lengths), num_sink=num_sink, window=N)
    n = np.clip(lengths, 0, N)
    s = np.minimum(np.minimum(np.clip(start, 0, N), num_sink), n)
    e = np.maximum(np.clip(end, 0, N), s)
    for out, lse in (masked, windowed):
        _assert_static_is_the_float64_selection(q, k, v, out, lse, s, e, n, num_sink, None)


def test_static_attention_window_past_the_row_start_reads_position_0():
    # W >= lengths (the window covers the whole row) with W < N: the slice of W positions starts at
    # 0, so position 0 is attended (a lower clip bound of 1 would drop it; static mutant 100).
    N, lengths, start, end = 8, [5, 8], [0, 0], [0, 0]
    q, k, v = make_qkv(21, N=N)
    out, lse = static_attention(q, k, v, i32(start), i32(end), i32(lengths), num_sink=0, window=6)
    _assert_static_is_the_float64_selection(q, k, v, out, lse, start, end, lengths, 0, 6)


@pytest.mark.parametrize("num_sink,window", [(0, 0), (2, 3), (2, None), (1, 1)])
def test_static_attention_under_x64_stays_float32(num_sink, window):
    N, lengths, start, end = 10, [10, 7], [2, 2], [6, 4]
    with jax.enable_x64(True):
        q, k, v = make_qkv(12, N=N)
        out, lse = static_attention(q, k, v, i32(start), i32(end), i32(lengths), num_sink=num_sink, window=window)
    assert (out.dtype, lse.dtype) == (np.float32, np.float32)
    _assert_static_is_the_float64_selection(q, k, v, out, lse, start, end, lengths, num_sink, window)


def test_static_attention_messages():
    q, k, v = make_qkv(2, N=6)
    n = i32([6, 6])
    assert message(ValueError, static_attention, q, k, v, n, n, n, num_sink=-1) == (
        "num_sink must be >= 0, got num_sink=-1"
    )
    assert message(ValueError, static_attention, q, k, v, n, n, n, num_sink=0, window=-1) == (
        "window must be >= 0 or None, got window=-1"
    )


# --- merge -----------------------------------------------------------------------------------


def _merge64(out_a, lse_a, out_b, lse_b):
    """Float64 ``(s_a out_a + s_b out_b) / (s_a + s_b)``, ``log(s_a + s_b)`` with ``s = exp(lse)``."""
    out_a, lse_a, out_b, lse_b = (np.asarray(x, np.float64) for x in (out_a, lse_a, out_b, lse_b))
    lse = np.logaddexp(lse_a, lse_b)
    with np.errstate(invalid="ignore"):
        wa = np.where(np.isneginf(lse_a), 0.0, np.exp(lse_a - lse))
        wb = np.where(np.isneginf(lse_b), 0.0, np.exp(lse_b - lse))
    return wa[..., None] * out_a + wb[..., None] * out_b, lse


_lse = st.one_of(st.floats(-80, 80, width=32), st.just(-np.inf))


@given(lse=st.lists(st.tuples(_lse, _lse), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_merge_matches_float64(lse, seed):
    lse_a, lse_b = (np.asarray(x, np.float32) for x in zip(*lse, strict=True))
    out_a, out_b = np.random.default_rng(seed).normal(size=(2, len(lse), 3)).astype(np.float32)
    out, m_lse = merge_attention(jnp.asarray(out_a), jnp.asarray(lse_a), jnp.asarray(out_b), jnp.asarray(lse_b))
    r_out, r_lse = _merge64(out_a, lse_a, out_b, lse_b)
    both_empty = np.isneginf(lse_a) & np.isneginf(lse_b)
    np.testing.assert_array_equal(np.isneginf(m_lse), both_empty)
    np.testing.assert_allclose(np.where(both_empty, 0.0, m_lse), np.where(both_empty, 0.0, r_lse), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out, np.where(both_empty[:, None], 0.0, r_out), rtol=1e-5, atol=1e-6)


def test_merge_half_precision_parts_under_x64_stay_float32():
    rng = np.random.default_rng(3)
    out_a, out_b = rng.normal(size=(2, 2, 3, 5))
    lse_a, lse_b = rng.normal(size=(2, 2, 3)) * 3
    with jax.enable_x64(True):
        for dtype in (jnp.bfloat16, jnp.float16):
            args = [jnp.asarray(x, dtype) for x in (out_a, lse_a, out_b, lse_b)]
            out, lse = merge_attention(*args)
            assert (out.dtype, lse.dtype) == (np.float32, np.float32)
            r_out, r_lse = _merge64(*(np.asarray(x.astype(jnp.float32)) for x in args))
            np.testing.assert_allclose(out, r_out, rtol=1e-6, atol=1e-6)
            np.testing.assert_allclose(lse, r_lse, rtol=1e-6, atol=1e-6)


def test_merge_messages():
    a = jnp.ones((2, 3, 4))
    want = "merge_attention needs out_a/out_b of shape [..., D] and lse_a/lse_b of shape [...]; got "
    with without_jaxtyping():
        # each of the three conditions alone
        assert message(ValueError, merge_attention, a, a[..., 0], a[:, :2], a[..., 0]) == (
            want + "(2, 3, 4), (2, 3), (2, 2, 4), (2, 3)"
        )
        assert message(ValueError, merge_attention, a, a[..., 0], a, a[:, :2, 0]) == (
            want + "(2, 3, 4), (2, 3), (2, 3, 4), (2, 2)"
        )
        assert message(ValueError, merge_attention, a, a[..., :2, 0], a, a[..., :2, 0]) == (
            want + "(2, 3, 4), (2, 2), (2, 3, 4), (2, 2)"
        )


# --- cost_model ------------------------------------------------------------------------------


def _fraction64(cos, K, L):
    p = 1 - np.arccos(np.clip(cos, -1, 1)) / np.pi
    return float(np.mean(stats.binom.sf(1, L, p**K)))


def test_tables_for_fraction_small_l_by_hand():
    # K = 1, cos = 0: p = 1/2, u(L) = P(Binomial(L, 1/2) >= 2) = 1 - (L + 1) / 2^L:
    # u(2) = 1/4, u(3) = 1/2, u(4) = 11/16, u(5) = 13/16
    zeros = np.zeros(3)
    f = {L: cost_model.expected_sampled_fraction(zeros, 1, L) for L in range(2, 10)}
    for L, u in f.items():
        assert u == pytest.approx(1 - (L + 1) / 2**L, rel=1e-6)
    assert cost_model.tables_for_fraction(zeros, 1, 0.4) == 3
    assert cost_model.tables_for_fraction(zeros, 1, 0.2) == 2
    assert cost_model.tables_for_fraction(zeros, 1, 0.6) == 4
    # a target equal to the fraction at L is reached at L, not one table later (f is
    # strictly increasing); max_L = L ends the exponential search at the cap
    for L, u in f.items():
        assert cost_model.tables_for_fraction(zeros, 1, u) == L
        assert cost_model.tables_for_fraction(zeros, 1, u, max_L=L) == L
    # u(4) < 3/4 <= u(5): not reachable with 4 tables
    with pytest.raises(ValueError) as err:
        cost_model.tables_for_fraction(zeros, 1, 0.75, max_L=4)
    assert str(err.value) == "target fraction 0.75 is not reached with K=1 and L <= 4"
    assert cost_model.tables_for_fraction(zeros, 1, 0.75, max_L=5) == 5


@settings(max_examples=25)
@given(
    cos=st.lists(st.floats(-0.5, 0.9), min_size=1, max_size=6),
    K=st.integers(1, 4),
    target=st.floats(0.05, 0.95),
)
def test_tables_for_fraction_is_the_boundary_of_the_float64_fraction(cos, K, target):
    cos = np.asarray(cos)
    L = cost_model.tables_for_fraction(cos, K, target, max_L=1 << 12)
    assert L >= 2 and _fraction64(cos, K, L) >= target * (1 - 1e-4)
    if L > 2:
        assert _fraction64(cos, K, L - 1) < target * (1 + 1e-4)


# --- layer_configs ---------------------------------------------------------------------------


def _obj(**layers):
    return {"format": FORMAT, "num_sink": 4, "num_local": 64, "seed": 0, "layers": layers}


def test_layer_configs_json_messages():
    with pytest.raises(ValueError) as err:
        LayerConfigs.from_json({"format": FORMAT, "num_sink": 4, "num_local": 64, "layers": {}})
    assert str(err.value) == "layer-configs file lacks seed"
    with pytest.raises(ValueError) as err:
        LayerConfigs.from_json(dict(_obj(), layers=["dense"]))
    assert str(err.value) == "layer-configs 'layers' must map layer -> {'K', 'L'} or 'dense'"
    with pytest.raises(ValueError) as err:
        LayerConfigs.from_json(_obj(first="dense"))
    assert str(err.value) == "layer-configs: layer key 'first' is not a layer index (decimal digits, as '0', '12')"
    for key in ("1_0", " 5 ", "01", "-0", "+1", "\u0661"):  # int() reads each as a layer
        with pytest.raises(ValueError, match=re.escape(f"layer key {key!r} is not a layer index")):
            LayerConfigs.from_json(_obj(**{key: "dense"}))
    with pytest.raises(ValueError) as err:
        LayerConfigs.from_json(_obj(**{"0": {"K": 4}}))
    assert str(err.value) == "layer-configs: layer 0 must be 'dense' or {'K': .., 'L': ..}, got {'K': 4}"
    # a sequence holding the names "K" and "L" is not a {K, L} mapping
    with pytest.raises(ValueError) as err:
        LayerConfigs.from_json(_obj(**{"0": ["K", "L"]}))
    assert str(err.value) == "layer-configs: layer 0 must be 'dense' or {'K': .., 'L': ..}, got ['K', 'L']"


def test_layer_configs_load_messages(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        LayerConfigs.load(tmp_path / "none.json")
    assert str(err.value) == f"layer-configs file {tmp_path / 'none.json'} does not exist"


def test_layer_configs_save_makes_the_parent_directories(tmp_path):
    lc = LayerConfigs(((0, MagicPIGConfig(K=4, L=10)), (1, "dense")))
    path = lc.save(tmp_path / "a" / "b" / "cfg.json")
    assert path == tmp_path / "a" / "b" / "cfg.json"
    assert LayerConfigs.load(path) == lc


def test_hybrid_layer_round_trip_keeps_the_static_set_and_seed():
    hy = LayerConfigs(((0, HybridConfig(K=4, L=10, heavy=5, num_sink=2, num_local=16, seed=7)), (1, "dense")))
    back = LayerConfigs.from_json(json.loads(json.dumps(hy.to_json())))
    assert back == hy
    assert (back.base().num_sink, back.base().num_local, back.base().seed, back.base().heavy) == (2, 16, 7, 5)


# --- _common and baselines under x64 -----------------------------------------------------------


def test_estimators_under_x64_keep_their_dtypes_and_match_float64():
    # x64 makes the default integer int64 and the default float float64: an index, length or
    # logit built without its int32/float32 dtype is then refused under strict promotion or
    # comes out float64 (the x64 mutants of check_lengths, grouped_logits, valid_mask, ...)
    from magicpig_jax.attention import oracle_sampling_attention, quest_attention, topk_attention
    from magicpig_jax.attention._common import check_lengths

    N, lengths = 13, [13, 6]
    with jax.enable_x64(True):
        q, k, v = make_qkv(31, N=N, D=8, scale=1.5)
        default = check_lengths(None, 2, N)
        results = {
            "dense": dense_attention(q, k, v, i32(lengths)),
            "dense_default": dense_attention(q, k, v),
            "dense_int64": dense_attention(q, k, v, jnp.asarray(lengths, jnp.int64)),
            "topk": topk_attention(q, k, v, 4, i32(lengths)),
            "topk_frac": topk_attention(q, k, v, 0.5, i32(lengths)),
            "quest": quest_attention(q, k, v, 3, 5, i32(lengths)),
            "quest_frac": quest_attention(q, k, v, 2, 0.5, i32(lengths)),
            "oracle": oracle_sampling_attention(jax.random.key(4), q, k, v, 7, i32(lengths)),
        }
    assert default.dtype == np.int32
    np.testing.assert_array_equal(default, [N, N])
    for name, res in results.items():
        assert tuple(x.dtype for x in res) == (np.float32, np.float32, np.int32)[: len(res)], name
    r_dense = ref.dense(q, k, v, lengths)
    for name, want in (("dense", r_dense), ("dense_default", ref.dense(q, k, v)), ("dense_int64", r_dense)):
        np.testing.assert_allclose(results[name][0], want[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(results[name][1], want[1], rtol=1e-6, atol=1e-6)
    n = np.asarray(lengths)
    for name, keep in (
        ("topk", ref.topk_keep(q, k, [4, 4], n)),
        ("topk_frac", ref.topk_keep(q, k, [7, 3], n)),
        ("quest", ref.quest_keep(q, k, 3, [5, 5], n)),
        ("quest_frac", ref.quest_keep(q, k, 2, [7, 3], n)),
    ):
        r_out, r_lse = ref.selected(q, k, v, keep)
        np.testing.assert_allclose(results[name][0], r_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(results[name][1], r_lse, rtol=1e-6, atol=1e-6)
    out, lse, distinct = results["oracle"]
    np.testing.assert_allclose(lse, r_dense[1], rtol=1e-6, atol=1e-6)
    assert np.all((distinct >= 1) & (distinct <= np.minimum(7, n)[:, None]))


def test_lengths_outside_0_n_are_clipped_for_every_estimator():
    # lengths past N or negative mean N or 0 keys: a fractional budget, MagicPIG's hashed range and
    # the index's mean and range are computed from the clipped length (check_lengths' clip)
    from magicpig_jax.attention import oracle_sampling_attention, quest_attention, topk_attention

    N = 12
    over, under = [N + 7, -3], [N, 0]
    q, k, v = make_qkv(41, N=N, D=8, scale=1.5, cone=1.0)
    for budget, tokens in ((0.5, [6, 0]), (5, [5, 5])):
        out, lse = topk_attention(q, k, v, budget, i32(over))
        r_out, r_lse = ref.selected(q, k, v, ref.topk_keep(q, k, tokens, under))
        np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse, r_lse, rtol=1e-6, atol=1e-6)
        out, lse = quest_attention(q, k, v, 3, budget, i32(over))
        r_out, r_lse = ref.selected(q, k, v, ref.quest_keep(q, k, 3, tokens, under))
        np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(lse, r_lse, rtol=1e-6, atol=1e-6)
    # oracle sampling with v_i = e_i: out * draws is the vector of draw counts, ceil(N / 2) draws
    qe = jnp.asarray(np.random.default_rng(2).normal(size=(2, 4, N)), jnp.float32)
    ke = jnp.asarray(np.random.default_rng(3).normal(size=(2, 2, N, N)), jnp.float32)
    ve = jnp.broadcast_to(jnp.eye(N, dtype=jnp.float32), (2, 2, N, N))
    out, lse, distinct = oracle_sampling_attention(jax.random.key(7), qe, ke, ve, 0.5, i32(over))
    counts = np.asarray(out[0], np.float64) * 6
    np.testing.assert_allclose(counts, np.round(counts), atol=1e-4)
    np.testing.assert_allclose(counts.sum(-1), 6, atol=1e-4)
    np.testing.assert_array_equal(distinct[0], np.sum(np.round(counts) > 0, -1))
    np.testing.assert_allclose(lse[0], ref.dense(qe, ke, ve)[1][0], rtol=1e-6)
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(distinct[1], 0)
    assert np.all(np.isneginf(lse[1]))
    # MagicPIG: the index built at lengths past N and below 0, then attended at such lengths
    K, L, ns, nl = 3, 10, 2, 3
    cfg = MagicPIGConfig(K=K, L=L, num_sink=ns, num_local=nl)
    proj = lsh.simhash_projections(jax.random.key(5), 8, K, L)
    index = build_lsh_index(k, proj, cfg, i32([N + 9, -4]))
    np.testing.assert_array_equal(index.start, [ns, 0])
    np.testing.assert_array_equal(index.end, [N - nl, 0])
    out, lse, num = magicpig_attention(q, k, v, index, cfg, i32(over))
    qcodes = np.asarray(lsh.simhash_codes(q, proj, K, L))
    r_out, r_lse, r_num = ref.magicpig(q, k, v, np.asarray(index.codes), qcodes, K, L, ns, nl, under, under)
    np.testing.assert_array_equal(num, r_num)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("G,N,per_head", [(2, 1, True), (2, 4, True), (3, 4, True), (2, 4, False), (1, 3, True)])
def test_masked_softmax_selects_out_non_finite_values_per_head(G, N, per_head):
    # a value row outside a head's mask is NaN or inf: the heads that do not select it are exact,
    # whatever the mask's head axis (1, or G with different keys per head; N = 1 included)
    from magicpig_jax.attention._common import masked_softmax_attention

    rng = np.random.default_rng(G * 10 + N)
    B, Hkv, D = 2, 2, 3
    logits = rng.normal(size=(B, Hkv, G, N)).astype(np.float32)
    mask = rng.random(size=(B, Hkv, G if per_head else 1, N)) < 0.5
    mask[0, 0, 0, 0], mask[0, 0, -1, 0] = True, False  # head 0 keeps key 0, the last head does not
    if not per_head:
        mask[0, 0, 0, 0] = False
    v = rng.normal(size=(B, Hkv, N, D)).astype(np.float32)
    v[0, 0, 0] = [np.nan, np.inf, -np.inf]
    out, lse = masked_softmax_attention(jnp.asarray(logits), jnp.asarray(mask), jnp.asarray(v))
    full = np.broadcast_to(mask, logits.shape)
    for b in range(B):
        for h in range(Hkv):
            for g in range(G):
                sel = full[b, h, g]
                if not sel.any():
                    want_out, want_lse = np.zeros(D), -np.inf
                else:
                    x = logits[b, h, g][sel].astype(np.float64)
                    e = np.exp(x - x.max())
                    with np.errstate(invalid="ignore"):
                        want_out = e @ v[b, h][sel].astype(np.float64) / e.sum()
                    want_lse = x.max() + np.log(e.sum())
                np.testing.assert_allclose(out[b, h * G + g], want_out, rtol=1e-5, atol=1e-6)
                np.testing.assert_allclose(lse[b, h * G + g], want_lse, rtol=1e-6, atol=1e-6)


# --- hybrid ----------------------------------------------------------------------------------


def _log_uc64(p, K, L, m):
    """float64 ``log P[X >= 2 | X < m]``, ``X ~ Binomial(L, clip(p, 0, 1)^K)`` (SciPy's log pmf)."""
    P = np.clip(np.asarray(p, np.float64), 0.0, 1.0) ** K
    with np.errstate(divide="ignore", invalid="ignore"):  # P = 0 or 1: log 0 (the where picks -inf or 0)
        lp = stats.binom.logpmf(np.arange(m), L, P[..., None])
        num = np.log(np.sum(np.exp(lp[..., 2:]), -1))
        den = np.log(np.sum(np.exp(lp), -1))
        return np.where(P > 0, np.where(P < 1, num - den, 0.0), -np.inf)


def _hybrid64(q, k, v, key_codes, query_codes, K, L, m, num_sink, num_local, build_lengths, lengths):
    """Float64 hybrid estimator given the codes: a sampled key (>= 2 collisions in the hashed range)
    enters with ``q·k/sqrt(D)`` if ``hits >= m``, else ``- max(log u_c, log 1e-30)``; every other
    valid key is exact (``ref.magicpig`` with the hybrid's weights)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out, lse, num = np.zeros((B, Hq, D)), np.zeros((B, Hq)), np.zeros((B, Hq), np.int64)
    for b in range(B):
        n0, n = int(build_lengths[b]), int(lengths[b])
        start = min(num_sink, n0)
        end = max(n0 - num_local, start)
        for h in range(Hq):
            kh, vh = k[b, h // G], v[b, h // G]
            mean = kh[start:end].mean(0) if end > start else np.zeros(D)
            logits = kh @ q[b, h] / np.sqrt(D)
            mask = np.zeros(N, bool)
            for i in range(n):
                if not start <= i < end:
                    mask[i] = True
                    continue
                hits = int(np.sum(key_codes[b, h // G, i] == query_codes[b, h]))
                if hits < 2:
                    continue
                kc = kh[i] - mean
                nq, nk = np.linalg.norm(q[b, h]), np.linalg.norm(kc)
                cos = q[b, h] @ kc / (nq * nk) if nq * nk > 0 else 0.0
                p = 1 - np.arccos(np.clip(cos, -1, 1)) / np.pi
                if hits < m:
                    logits[i] -= max(float(_log_uc64(p, K, L, m)), ref.LOG_U_FLOOR)
                mask[i] = True
                num[b, h] += 1
            out[b, h], lse[b, h] = ref.softmax_over(logits, mask, vh)
    return out, lse, num


def test_hybrid_messages_and_bounds():
    from magicpig_jax.attention import hybrid_attention
    from magicpig_jax.attention.hybrid import log_light_probability

    want = "heavy must be in [3, L + 1] = [3, 11], got heavy={}"
    for heavy in (2, 12):
        assert message(ValueError, HybridConfig, K=4, L=10, heavy=heavy) == want.format(heavy)
        assert message(ValueError, log_light_probability, jnp.float32(0.5), 4, 10, heavy) == want.format(heavy)
    with without_jaxtyping():
        assert message(TypeError, HybridConfig, K=4, L=10, heavy=3.0) == "heavy must be an int, got float 3.0"
        assert message(TypeError, HybridConfig, K=4, L=10, heavy=True) == "heavy must be an int, got bool True"
        for bad in (3.5, "5", None):  # a float failed in range(), a str or None at '<=', naming nothing
            assert message(TypeError, log_light_probability, jnp.float32(0.5), 4, 10, bad).startswith(
                "heavy must be an int, got")
    assert message(ValueError, HybridConfig, K=4, L=10, heavy=-1) == "heavy must be >= 0, got heavy=-1"
    assert message(ValueError, log_light_probability, jnp.float32(0.5), 0, 10, 3) == (
        "K must be in [1, 32] (bits per uint32 code), got K=0"
    )
    assert message(ValueError, log_light_probability, jnp.float32(0.5), 4, 1, 3) == (
        "L must be >= 2 (sampling needs >= 2 colliding tables), got L=1"
    )
    # the bounds are accepted: heavy = 3 and heavy = L + 1
    for heavy in (3, 11):
        assert HybridConfig(K=4, L=10, heavy=heavy).heavy == heavy
        got = log_light_probability(jnp.float32(0.7), 4, 10, heavy)
        np.testing.assert_allclose(got, _log_uc64(np.float32(0.7), 4, 10, heavy), rtol=1e-5)
    q, k, v = make_qkv(5, N=10, D=8)
    base = MagicPIGConfig(K=4, L=10)
    index = build_lsh_index(k, lsh.simhash_projections(jax.random.key(0), 8, 4, 10), base)
    with without_jaxtyping():
        assert message(TypeError, hybrid_attention, q, k, v, index, base) == (
            "config must be a HybridConfig, got MagicPIGConfig"
        )
    assert message(ValueError, hybrid_attention, q, k, v, index, HybridConfig(K=4, L=12)) == (
        "the index was built with L=10 tables (index.codes (2, 2, 10, 10)) but config has L=12: "
        "build the index with this config"
    )
    assert message(ValueError, hybrid_attention, q[:, :3], k, v, index, HybridConfig(K=4, L=10)) == (
        "Hq (3) must be a multiple of Hkv (2) for GQA"
    )


def test_hybrid_light_probability_and_weights_by_hand_and_under_x64():
    from magicpig_jax.attention.hybrid import hybrid_log_weights, log_light_probability

    K, L, m = 2, 9, 4
    p = np.array([[-0.3, 0.0, 0.2, 0.55], [0.8, 0.97, 1.0, 1.7]], np.float32)  # clipped to [0, 1]
    want = _log_uc64(p, K, L, m)
    assert np.all(np.isneginf(want[0, :2])) and np.all(want[1, 2:] == 0)
    hits = np.array([[0, 2, 3, 4], [5, 3, 4, 1]], np.int32)  # hits >= m: heavy, weight 0
    want_w = np.where(hits >= m, 0.0, np.maximum(want, ref.LOG_U_FLOOR))
    with jax.enable_x64(True):
        got = log_light_probability(jnp.asarray(p, jnp.float64), K, L, m)
        got_w = hybrid_log_weights(jnp.asarray(hits), jnp.asarray(p, jnp.float64), K, L, m)
    got32 = log_light_probability(jnp.asarray(p), K, L, m)
    assert (got.dtype, got_w.dtype, got32.dtype) == (np.float32, np.float32, np.float32)
    for g in (got, got32):
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(np.asarray(g)[finite], want[finite], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("x64", [False, True])
def test_hybrid_with_lengths_small_norms_and_x64_matches_float64(x64):
    from magicpig_jax.attention import hybrid_attention

    K, L, m, ns, nl, N = 2, 8, 4, 2, 3, 30
    cfg = HybridConfig(K=K, L=L, heavy=m, num_sink=ns, num_local=nl)
    with jax.enable_x64(x64):
        q, k, v = make_qkv(61, B=3, N=N, D=8, scale=0.3, cone=0.5)  # |q| |k - mean| < 1 for most keys
        # row 2 hashes one key (range [2, 3)): it is its own mean, a centered key of norm 0 (cos 0)
        build, lengths = [N - 4, N, ns + nl + 1], [N - 2, N, 6]
        proj = lsh.simhash_projections(jax.random.key(9), 8, K, L)
        index = build_lsh_index(k, proj, cfg, i32(build))
        out, lse, num = hybrid_attention(q, k, v, index, cfg, i32(lengths))
        qcodes = np.asarray(lsh.simhash_codes(q, proj, K, L))
    assert (out.dtype, lse.dtype, num.dtype) == (np.float32, np.float32, np.int32)
    r_out, r_lse, r_num = _hybrid64(q, k, v, np.asarray(index.codes), qcodes, K, L, m, ns, nl, build, lengths)
    assert 0 < r_num.sum() < 3 * 4 * N
    np.testing.assert_array_equal(num, r_num)
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-5, atol=1e-5)


# --- baselines -------------------------------------------------------------------------------


def test_baseline_budget_and_page_size_messages_and_bounds():
    from magicpig_jax.attention import oracle_sampling_attention, quest_attention, topk_attention
    from magicpig_jax.attention.baselines import quest_page_scores

    q, k, v = make_qkv(8, N=10, D=8)
    kind = "budget must be an int (tokens) or a float in (0, 1] (fraction of the context), got "
    count = "budget as a token count must be >= 1, got budget={}"
    frac = "budget as a fraction of the context must be in (0, 1], got budget={}"
    cases = [
        (True, TypeError, kind + "bool True"),
        ("3", TypeError, kind + "str '3'"),
        (None, TypeError, kind + "NoneType None"),
        (0, ValueError, count.format(0)),
        (-2, ValueError, count.format(-2)),
        (0.0, ValueError, frac.format(0.0)),
        (1.5, ValueError, frac.format(1.5)),
        (float("inf"), ValueError, frac.format(float("inf"))),
        (float("nan"), ValueError, frac.format(float("nan"))),
        # int32 on the device: 2**32 + 1 would have wrapped to a budget of 1 token
        (2**31, ValueError, "budget as a token count must be <= 2147483647 (2**31 - 1; a budget above a row's "
                            "length keeps every key), got budget=2147483648"),
        (2**32 + 1, ValueError, "budget as a token count must be <= 2147483647 (2**31 - 1; a budget above a row's "
                                "length keeps every key), got budget=4294967297"),
    ]
    with without_jaxtyping():
        for budget, exc, want in cases:
            assert message(exc, budget_tokens, budget, i32([4])) == want, budget
            assert message(exc, topk_attention, q, k, v, budget) == want, budget
            assert message(exc, quest_attention, q, k, v, 2, budget) == want, budget
            assert message(exc, oracle_sampling_attention, jax.random.key(0), q, k, v, budget) == want, budget
        for page_size, exc, want in [
            (0, ValueError, "page_size must be in [1, 65536], got page_size=0"),
            (2**32 + 16, ValueError, "page_size must be in [1, 65536], got page_size=4294967312"),
            (2.0, TypeError, "page_size must be an int, got float 2.0"),
            (False, TypeError, "page_size must be an int, got bool False"),
        ]:
            assert message(exc, quest_attention, q, k, v, page_size, 4) == want
            assert message(exc, quest_page_scores, q, k, page_size, i32([10, 10])) == want
    # the bounds are accepted: a budget of 1 token, a fraction of 1.0, a page of 1 key
    np.testing.assert_array_equal(budget_tokens(1, i32([0, 9])), [1, 1])
    np.testing.assert_array_equal(budget_tokens(1.0, i32([0, 9])), [0, 9])
    # 1 / 32768 is the smallest fraction: ceil(n / 32768) tokens
    np.testing.assert_array_equal(budget_tokens(2.0**-15, i32([0, 1, 32768, 32769])), [0, 1, 1, 2])
    # one that no num/den (den <= 32768) comes within 0.1% of is refused, not inflated (1e-5 -> 1/32768
    # would grant 3x the keys); lengths past int32 count as 2**31 - 1, not wrapped
    for tiny, off in ((1e-7, "100.0%"), (1e-5, "100.0%"), (3e-5, "1.7%")):
        with pytest.raises(ValueError, match=f"budget as a fraction must be within 0.1%.*budget={tiny}, {off}"):
            budget_tokens(tiny, i32([10]))
    # (unsigned and host int64 lengths are outside the Int[Array] annotation the suite's hook checks,
    # but a caller without the hook may pass them: the function itself, unwrapped)
    top, unchecked = 2**31 - 1, inspect.unwrap(budget_tokens)
    np.testing.assert_array_equal(unchecked(0.5, jnp.array([2**32 - 1, 7], jnp.uint32)), [-(-top // 2), 4])
    np.testing.assert_array_equal(unchecked(0.5, np.array([2**31 + 5, -3], np.int64)), [-(-top // 2), 0])
    out, lse = quest_attention(q, k, v, 1, 1, i32([10, 3]))
    r_out, r_lse = ref.selected(q, k, v, ref.quest_keep(q, k, 1, [1, 1], [10, 3]))
    np.testing.assert_allclose(out, r_out, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lse, r_lse, rtol=1e-6, atol=1e-6)
