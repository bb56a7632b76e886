"""Cache bookkeeping: prefill + step-by-step decode equals a full forward; batch rows are independent."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.eval.forcing import forced_decode
from magicpig_jax.generation import Sampling, decode, forward_logits, prefill
from magicpig_jax.models.decoding import DecodeSpec, build_indices, decode_step
from tests._tiny import tiny_model


def _decode_with_logits(model, prompts, steps, spec):
    """Greedy decode via the jitted step, returning tokens and logits per step."""
    state = prefill(model, prompts, steps)
    cache = state.cache.copy()
    graphdef, params = nnx.split(model.module)
    indices = build_indices(cache, spec, model.config.num_layers)
    logits = [np.asarray(state.last_logits)]
    tokens = jnp.argmax(state.last_logits, -1).astype(jnp.int32)
    toks = [np.asarray(tokens)]
    for _ in range(steps):
        tokens, lg, _, cache, indices = decode_step(graphdef, params, cache, indices, tokens, jax.random.key(0),
                                                    jnp.float32(0), jnp.float32(1), spec=spec)
        logits.append(np.asarray(lg))
        toks.append(np.asarray(tokens))
    return np.stack(toks, 1), np.stack(logits, 1)  # [B, steps+1], [B, steps+1, V]


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def test_decode_matches_full_forward(model):
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.config.vocab_size, 300).tolist()  # spans two prefill chunks
    toks, logits = _decode_with_logits(model, [prompt], 12, DecodeSpec("dense"))
    full = forward_logits(model, prompt + toks[0, :-1].tolist())
    # logits after the prompt and after each generated token
    expected = full[len(prompt) - 1:]
    np.testing.assert_allclose(logits[0], expected, atol=1e-4, rtol=0)
    assert (toks[0] == expected.argmax(-1)).all()


def test_batch_rows_equal_rows_alone(model):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 97, n).tolist() for n in (5, 260, 77)]
    spec = DecodeSpec("dense")
    toks, logits = _decode_with_logits(model, prompts, 6, spec)
    for b, p in enumerate(prompts):
        t1, l1 = _decode_with_logits(model, [p], 6, spec)
        np.testing.assert_array_equal(toks[b], t1[0])
        np.testing.assert_allclose(logits[b], l1[0], atol=1e-4, rtol=0)


def test_magicpig_with_static_context_equals_dense(model):
    rng = np.random.default_rng(2)
    prompt = rng.integers(0, 97, 40).tolist()
    cfg = MagicPIGConfig(K=4, L=8, num_sink=4, num_local=64)  # 40 <= 4 + 64: every key static
    t_d, l_d = _decode_with_logits(model, [prompt], 5, DecodeSpec("dense"))
    t_m, l_m = _decode_with_logits(model, [prompt], 5, DecodeSpec("magicpig", cfg, ()))
    np.testing.assert_array_equal(t_d, t_m)
    np.testing.assert_allclose(l_m, l_d, atol=1e-4, rtol=0)


def test_magicpig_decode_samples_and_reports_fraction(model):
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 97, 600).tolist()
    cfg = MagicPIGConfig(K=2, L=10, num_sink=4, num_local=16)
    state = prefill(model, [prompt], 8)
    outs, stats = decode(model, state, attention="magicpig", max_new_tokens=8, config=cfg,
                         dense_layers=[0], stop_on_eos=False)
    assert len(outs[0]) == 8
    assert set(stats["sampled_fraction_per_layer"]) == {1, 2}
    frac = stats["sampled_fraction"]
    assert 0.0 < frac < 1.0
    # the prefill cache is not consumed: dense decode from the same state still works and is deterministic
    d1, _ = decode(model, state, attention="dense", max_new_tokens=8, stop_on_eos=False)
    d2, _ = decode(model, state, attention="dense", max_new_tokens=8, stop_on_eos=False)
    assert d1 == d2


def test_sampling_is_seeded(model):
    prompt = list(range(1, 30))
    state = prefill(model, [prompt], 10)
    a, _ = decode(model, state, attention="dense", max_new_tokens=10,
                  sampling=Sampling(temperature=1.0, top_p=0.9, seed=3), stop_on_eos=False)
    b, _ = decode(model, state, attention="dense", max_new_tokens=10,
                  sampling=Sampling(temperature=1.0, top_p=0.9, seed=3), stop_on_eos=False)
    c, _ = decode(model, state, attention="dense", max_new_tokens=10,
                  sampling=Sampling(temperature=1.0, top_p=0.9, seed=4), stop_on_eos=False)
    assert a == b
    assert a != c


def test_decode_rejects_bad_arguments(model):
    state = prefill(model, [[1, 2, 3]], 4)
    with pytest.raises(ValueError, match="attention must be one of"):
        decode(model, state, attention="sparse")
    with pytest.raises(ValueError, match="dense_layers"):
        decode(model, state, attention="magicpig", dense_layers=[7], max_new_tokens=2)
    with pytest.raises(ValueError, match="top_p"):
        decode(model, state, attention="dense", sampling=Sampling(top_p=0.0), max_new_tokens=2)
    with pytest.raises(ValueError, match="longer than the model's context"):
        prefill(model, [[1] * 5000], 4)
    with pytest.raises(ValueError, match="non-empty"):
        prefill(model, [[]], 4)


@pytest.mark.parametrize("backend", ["topk", "quest", "oracle"])
def test_budgeted_backends_with_full_budget_equal_dense(model, backend):
    rng = np.random.default_rng(4)
    prompt = rng.integers(0, 97, 300).tolist()
    cfg = MagicPIGConfig(num_sink=4, num_local=16)
    t_d, l_d = _decode_with_logits(model, [prompt], 4, DecodeSpec("dense"))
    # a budget covering the whole middle range makes TopK/Quest exact
    spec = DecodeSpec(backend, cfg, (), budget=1.0 if backend != "oracle" else 4096)
    t_b, l_b = _decode_with_logits(model, [prompt], 4, spec)
    if backend == "oracle":  # 4096 draws: a close, not exact, estimate
        assert np.abs(l_b - l_d).max() < 0.5
    else:
        np.testing.assert_array_equal(t_b, t_d)
        np.testing.assert_allclose(l_b, l_d, atol=1e-4, rtol=0)


def test_budgeted_backends_touch_the_budget(model):
    rng = np.random.default_rng(5)
    prompt = rng.integers(0, 97, 500).tolist()
    state = prefill(model, [prompt], 4)
    cfg = MagicPIGConfig(num_sink=4, num_local=16)
    for backend in ("topk", "quest"):
        _, stats = decode(model, state, attention=backend, max_new_tokens=4, config=cfg, budget=32,
                          dense_layers=[], stop_on_eos=False)
        # 32 of the ~500 context keys per step
        assert stats["sampled_fraction"] == pytest.approx(32 / 501.5, rel=0.01)
    with pytest.raises(ValueError, match="needs a budget"):
        decode(model, state, attention="topk", max_new_tokens=2)


def test_host_magicpig_decode_equals_reference_path(model):
    """The decoder's default "magicpig" (host op on CPU) equals "magicpig-ref" before any append."""
    rng = np.random.default_rng(6)
    prompt = rng.integers(0, 97, 700).tolist()
    cfg = MagicPIGConfig(K=3, L=12, num_sink=4, num_local=16)
    host = DecodeSpec("magicpig", cfg, (0,))
    ref = DecodeSpec("magicpig-ref", cfg, (0,))
    assert host.uses_host and not ref.uses_host
    t_h, l_h = _decode_with_logits(model, [prompt], 6, host)
    t_r, l_r = _decode_with_logits(model, [prompt], 6, ref)
    np.testing.assert_array_equal(t_h, t_r)
    np.testing.assert_allclose(l_h, l_r, atol=2e-4, rtol=0)


def _ref_with_appends(model, prompt, steps, cfg, buffer):
    """Pure-JAX MagicPIG with the host path's append schedule, re-implemented step by step."""
    from magicpig_jax import lsh
    from magicpig_jax.models.decoding import layer_projections

    spec = DecodeSpec("magicpig-ref", cfg, ())
    state = prefill(model, [prompt], steps)
    cache = state.cache.copy()
    graphdef, params = nnx.split(model.module)
    indices = list(build_indices(cache, spec, model.config.num_layers))
    tokens = jnp.argmax(state.last_logits, -1).astype(jnp.int32)
    toks, logits = [np.asarray(tokens)], [np.asarray(state.last_logits)]
    for _ in range(steps):
        tokens, lg, _, cache, indices = decode_step(graphdef, params, cache, tuple(indices), tokens,
                                                    jax.random.key(0), jnp.float32(0), jnp.float32(1), spec=spec)
        indices = list(indices)
        toks.append(np.asarray(tokens))
        logits.append(np.asarray(lg))
        length = int(cache.lengths[0])
        for i, idx in enumerate(indices):
            end = int(idx.end[0])
            if length - end >= cfg.num_local + 2 * buffer:  # the host schedule: append `buffer` keys
                proj = layer_projections(cfg, i, model.config.head_dim)
                codes = lsh.simhash_codes(cache.k[i] - idx.mean[:, :, None, :], proj, cfg.K, cfg.L)
                pos = jnp.arange(cache.capacity)
                new = (pos >= end) & (pos < end + buffer)
                merged = jnp.where(new[None, None, :, None], codes, idx.codes)
                indices[i] = type(idx)(codes=merged, mean=idx.mean, start=idx.start,
                                       end=idx.end + buffer, projections=idx.projections)
    return np.stack(toks, 1), np.stack(logits, 1)


def test_host_appends_generated_tokens_past_the_buffer(model):
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 97, 300).tolist()
    cfg = MagicPIGConfig(K=3, L=12, num_sink=4, num_local=8)
    buffer, steps = 4, 30  # appends at steps 16, 20, 24, 28
    spec = DecodeSpec("magicpig", cfg, (), generation_buffer=buffer)
    t_h, l_h = _decode_with_logits(model, [prompt], steps, spec)
    t_r, l_r = _ref_with_appends(model, prompt, steps, cfg, buffer)
    np.testing.assert_array_equal(t_h, t_r)
    np.testing.assert_allclose(l_h, l_r, atol=2e-4, rtol=0)


def test_bfloat16_kv_cache_host_decode_is_close_to_float32(model):
    rng = np.random.default_rng(8)
    prompt = rng.integers(0, 97, 500).tolist()
    cfg = MagicPIGConfig(K=3, L=12, num_sink=4, num_local=16)
    logits = {}
    for dtype in (jnp.float32, jnp.bfloat16):
        state = prefill(model, [prompt], 4, cache_dtype=dtype)
        assert state.cache.k[0].dtype == dtype
        got = []
        forced_decode(model, state, attention="magicpig", max_new_tokens=4, config=cfg, dense_layers=(),
                      stop_on_eos=False, logits_callback=lambda t, lg, got=got: got.append(lg))
        logits[dtype] = np.stack(got)
    assert np.isfinite(logits[jnp.bfloat16]).all()
    assert np.abs(logits[jnp.bfloat16] - logits[jnp.float32]).max() < 0.1


@pytest.mark.parametrize("backend", ["dense", "magicpig"])
def test_compiled_step_equals_decode_step_and_is_cached(model, backend):
    from magicpig_jax.models.decoding import compiled_decode_step

    rng = np.random.default_rng(3)
    prompt = rng.integers(0, model.config.vocab_size, 200).tolist()
    spec = DecodeSpec(backend, magicpig=MagicPIGConfig(K=4, L=8, num_sink=2, num_local=8), dense_layers=(0,))
    state = prefill(model, [prompt], 8)
    graphdef, params = nnx.split(model.module)
    leaves, treedef = jax.tree.flatten(params)
    step = compiled_decode_step(graphdef, treedef, spec)
    graphdef2, params2 = nnx.split(model.module)  # a new split of the same model hits the cache
    assert compiled_decode_step(graphdef2, jax.tree.structure(params2), spec) is step
    tokens = jnp.argmax(state.last_logits, -1).astype(jnp.int32)
    c1, c2 = state.cache.copy(), state.cache.copy()
    i1, i2 = build_indices(c1, spec, model.config.num_layers), build_indices(c2, spec, model.config.num_layers)
    key = jax.random.key(5)
    t1, l1, n1, c1, i1 = decode_step(graphdef, params, c1, i1, tokens, jax.random.fold_in(key, 3), jnp.float32(0.7),
                                     jnp.float32(0.9), spec=spec)
    t2, l2, n2, c2, i2 = step(leaves, c2, i2, tokens, key, np.int32(3), jnp.float32(0.7), jnp.float32(0.9))
    np.testing.assert_array_equal(np.asarray(t1), np.asarray(t2))
    np.testing.assert_array_equal(np.asarray(l1), np.asarray(l2))
    np.testing.assert_array_equal(np.asarray(n1), np.asarray(n2))
    np.testing.assert_array_equal(np.asarray(c1.k[1]), np.asarray(c2.k[1]))


def test_greedy_sampling_skips_the_sort_but_sampling_still_samples():
    from magicpig_jax.models.decoding import sample_token

    # jitted once, as the decode step calls it (eagerly, each call traces and compiles its cond again)
    sample_token = jax.jit(sample_token)
    logits = jnp.asarray(np.random.default_rng(0).standard_normal((3, 50)), jnp.float32)
    greedy = sample_token(logits, jax.random.key(0), jnp.float32(0), jnp.float32(1))
    np.testing.assert_array_equal(np.asarray(greedy), np.argmax(np.asarray(logits), -1))
    draws = {int(sample_token(logits, jax.random.key(s), jnp.float32(1.0), jnp.float32(1.0))[0]) for s in range(40)}
    assert len(draws) > 1  # temperature 1 over 50 similar logits: not always the argmax
    top = sample_token(logits, jax.random.key(1), jnp.float32(1.0), jnp.float32(1e-6))
    np.testing.assert_array_equal(np.asarray(top), np.argmax(np.asarray(logits), -1))  # top-p -> argmax only



def test_sample_token_marks_every_non_finite_row():
    # a model's logits are finite: NaN, +inf and -inf (e.g. an infinite scale in a Q4_1 block, which
    # the kernels turn into -inf where gguf-py's dequantization gives NaN) all mark the row -1
    from magicpig_jax.models.decoding import sample_token

    sample_token = jax.jit(sample_token)
    logits = np.random.default_rng(0).standard_normal((4, 20)).astype(np.float32)
    logits[1, 3], logits[2, 7], logits[3, 0] = np.nan, np.inf, -np.inf
    for temperature in (0.0, 0.8):
        tok = np.asarray(sample_token(jnp.asarray(logits), jax.random.key(0), jnp.float32(temperature),
                                      jnp.float32(1.0)))
        assert tok[0] >= 0 and list(tok[1:]) == [-1, -1, -1], (temperature, tok)


def test_sampling_at_a_tiny_temperature_keeps_ties_tied_and_has_no_floor():
    """logits / max(T, 1e-6) put the scaled logits near 2e7, where float32 rounds the Gumbel noise away:
    three tied tokens were drawn 58/25/17% (lowest id first) at T = 1e-6, and every T below 1e-6 was
    sampled as 1e-6. The reference: softmax(logits / T) in float64 (Hugging Face's warper)."""
    from magicpig_jax.models.decoding import sample_token

    sample_token = jax.jit(sample_token)
    rows = 30_000  # one categorical draw per row, all rows the same logits
    logits = np.tile(np.float32([20.0, 20.0, 20.0, 19.0]), (rows, 1))
    for temperature in (1e-6, 1e-30):
        tok = np.asarray(sample_token(jnp.asarray(logits), jax.random.key(3), jnp.float32(temperature),
                                      jnp.float32(1.0)))
        freq = np.bincount(tok, minlength=4) / rows
        np.testing.assert_allclose(freq[:3], 1 / 3, atol=0.015)  # sd 0.0027
        assert freq[3] == 0
    # below float32's smallest normal number the temperature is 0 (XLA flushes subnormals): greedy, as documented
    tok = np.asarray(sample_token(jnp.asarray(logits[:2]), jax.random.key(3), jnp.float32(1e-45), jnp.float32(1.0)))
    assert list(tok) == [0, 0]
    # a gap of one float32 step at 1.0 (1.19e-7), at T = 1e-7: softmax gives 0.767 / 0.233; at 1e-8, 6.6e-6
    logits = np.tile(np.float32([1.0, np.nextafter(np.float32(1.0), np.float32(0))]), (rows, 1))
    for temperature in (1e-7, 1e-8):
        gap = np.float64(logits[0, 0]) - np.float64(logits[0, 1])
        p1 = 1 / (1 + np.exp(gap / temperature))
        tok = np.asarray(sample_token(jnp.asarray(logits), jax.random.key(4), jnp.float32(temperature),
                                      jnp.float32(1.0)))
        assert abs(tok.mean() - p1) < 5 * np.sqrt(p1 * (1 - p1) / rows) + 1e-4, (temperature, tok.mean(), p1)


def test_top_p_one_keeps_the_whole_vocabulary(monkeypatch):
    """Once the float32 cumulative sum rounded to 1, (cum − p) < 1 failed: top_p = 1 never drew the tail.
    The draw is replaced by 'the last token still allowed', which must be the least likely one."""
    from magicpig_jax.models import decoding

    def last_allowed(key, logits, axis=-1):
        iota = jnp.arange(logits.shape[axis])
        return jnp.max(jnp.where(jnp.isfinite(logits), iota, -1), axis=axis)

    monkeypatch.setattr(decoding.jax.random, "categorical", last_allowed)
    logits = jnp.asarray([[0.0, -20.0, -30.0, -40.0, -5.0]], jnp.float32)  # the tail: 2e-9 .. 4e-18
    tok = decoding.sample_token(logits, jax.random.key(0), jnp.float32(1.0), jnp.float32(1.0))
    assert int(tok[0]) == 3
    tok = decoding.sample_token(logits, jax.random.key(0), jnp.float32(1.0), jnp.float32(0.999))
    assert int(tok[0]) == 4  # a nucleus below 1 still cuts where the mass says


def test_forced_tokens_outside_the_vocabulary_are_refused(model):
    """-1 wrapped to the last vocabulary row and was returned as id -1; 7.9 was cut to 7; an id past the
    vocabulary gave NaN logits blamed on the weights (FloatingPointError)."""
    state = prefill(model, [[1, 2, 3]], 4)
    V = model.config.vocab_size
    for forced, err, match in (([-1, 5], ValueError, r"forced_tokens\[0\] holds token id -1"),
                               ([V, 5], ValueError, rf"forced_tokens\[0\] holds token id {V}"),
                               ([7.9, 5], TypeError, r"forced_tokens\[0\] must hold integer")):
        with pytest.raises(err, match=match):
            forced_decode(model, state, forced_tokens=[forced], attention="dense", max_new_tokens=2)
    tokens, _ = forced_decode(model, state, forced_tokens=[np.asarray([5, 6], np.int64)], attention="dense",
                              max_new_tokens=2)
    assert list(tokens[0]) == [5, 6]


def test_a_numpy_integer_max_new_tokens_sizes_the_cache_as_a_python_int(model):
    """np.int32(2**31 - 1) overflowed in cache_capacity (capacity -2147483392); np.uint8(3) overflowed in
    the rounding."""
    from magicpig_jax.generation import cache_capacity

    for n in (np.int32(2**31 - 1), np.int16(32767), np.int8(100), np.uint8(3)):
        assert cache_capacity(model, 5, n) == cache_capacity(model, 5, int(n))
    state = prefill(model, [[1, 2, 3]], np.uint8(3))
    assert state.cache.capacity == cache_capacity(model, 3, 3)


_greedy_jit = None


@given(st.lists(st.lists(st.sampled_from([0.0, 1.0, -1.0, 2.5, float("inf"), float("-inf"), float("nan")]),
                         min_size=1, max_size=40), min_size=1, max_size=4).filter(
    lambda rows: len({len(r) for r in rows}) == 1))
@settings(max_examples=60, deadline=None)
def test_greedy_token_equals_numpy_argmax(rows):
    # greedy_token replaces jnp.argmax in the decode step: the first maximum, ties, +-inf, and the
    # first NaN when there is one, as NumPy's argmax (the independent reference).
    global _greedy_jit
    from magicpig_jax.models.decoding import greedy_token

    if _greedy_jit is None:
        _greedy_jit = jax.jit(greedy_token)
    x = np.asarray(rows, np.float32)
    got = np.asarray(_greedy_jit(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(x, axis=-1))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dense_decode_through_the_host_exact_op_equals_xla(model, dtype):
    # On the CPU backend "dense" runs every layer through the host exact op (it reads a bfloat16
    # cache in place); host=False keeps XLA's dense attention. Same cache, same tokens and logits.
    from magicpig_jax.models.backends import backend_for

    host, xla = DecodeSpec("dense"), DecodeSpec("dense", host=False)
    assert backend_for(host).name == "dense (host exact op)" and backend_for(xla).name == "dense"
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 97, n).tolist() for n in (300, 41)]
    out = {}
    for name, spec in (("host", host), ("xla", xla)):
        state = prefill(model, prompts, 6, cache_dtype=dtype)
        got = []
        forced_decode(model, state, spec=spec, max_new_tokens=6, stop_on_eos=False,
                      logits_callback=lambda t, lg, got=got: got.append(np.asarray(lg)))
        out[name] = np.stack(got)
    assert np.isfinite(out["host"]).all()
    np.testing.assert_allclose(out["host"], out["xla"], atol=2e-4, rtol=0)
    np.testing.assert_array_equal(out["host"].argmax(-1), out["xla"].argmax(-1))
