"""The decode loop: where rows stop (EOS, length, context), sampling, compilation, strict JSON stats."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magicpig_jax.decode_loop import Sampling
from magicpig_jax.generation import decode, forward_logits, prefill
from tests._tiny import TINY, tiny_model


@pytest.fixture(scope="module")
def small_context_model():
    return tiny_model(0, dataclasses.replace(TINY, max_position_embeddings=32))


@pytest.mark.parametrize("attention", ["dense", "magicpig"])
def test_decode_stops_at_the_context(small_context_model, attention):
    # Context 32, prompt 30: tokens are predicted at positions 29, 30, 31 -> 3 tokens, then stop.
    model = small_context_model
    state = prefill(model, [list(range(1, 31))], 10)
    outs, stats = decode(model, state, attention=attention, max_new_tokens=10, stop_on_eos=False)
    assert len(outs[0]) == 3
    assert stats["stop_reasons"] == ["context"]
    assert stats["decode_steps"] == 2  # two steps feed positions 30 and 31; nothing is written at 32


def test_a_huge_max_new_tokens_allocates_no_cache_past_the_context(small_context_model):
    """Context 32: a budget of a million tokens gets a cache of one chunk (the decode stops at the
    context anyway); it used to allocate a million positions per layer."""
    from magicpig_jax.generation import CHUNK

    model = small_context_model
    state = prefill(model, [list(range(1, 31))], 10**6)
    assert state.cache.capacity == CHUNK
    outs, stats = decode(model, state, attention="dense", max_new_tokens=10**6, stop_on_eos=False)
    assert len(outs[0]) == 3 and stats["stop_reasons"] == ["context"]
    assert prefill(model, [list(range(1, 31))], 2000, allow_beyond_context=True).cache.capacity > 2000


def test_rows_stop_at_their_own_limit(small_context_model):
    model = small_context_model
    state = prefill(model, [list(range(1, 31)), list(range(1, 11))], 5)
    outs, stats = decode(model, state, attention="dense", max_new_tokens=5, stop_on_eos=False)
    assert [len(o) for o in outs] == [3, 5]
    assert stats["stop_reasons"] == ["context", "length"]


@pytest.mark.parametrize("attention, budget", [("dense", None), ("magicpig", None), ("magicpig-ref", None),
                                               ("topk", 24), ("quest", 32)])
def test_a_row_stopped_by_the_context_lets_the_batch_decode_on(attention, budget):
    """Context 255, cache capacity 256: a 250-token row stops at the context after 6 tokens while a
    10-token row decodes 20. Every row takes every step, so the stopped row reached position 256 and
    the batch raised "decode step past the cache" (each row alone was fine). Now its steps write
    nothing once it is full, and each row's tokens equal the row decoded alone."""
    from magicpig_jax.generation import CHUNK

    model = tiny_model(0, dataclasses.replace(TINY, max_position_embeddings=CHUNK - 1))
    rng = np.random.default_rng(0)
    rows = [[int(t) for t in rng.integers(1, 90, 250)], [int(t) for t in rng.integers(1, 90, 10)]]
    kw = dict(attention=attention, max_new_tokens=20, stop_on_eos=False)
    if budget is not None:
        kw["budget"] = budget
    state = prefill(model, rows, 20)
    assert state.cache.capacity == CHUNK
    outs, stats = decode(model, state, **kw)
    assert stats["stop_reasons"] == ["context", "length"] and [len(o) for o in outs] == [6, 20]
    for row, out in zip(rows, outs, strict=True):
        alone, _ = decode(model, prefill(model, [row], 20), **kw)
        assert alone[0] == out


def test_one_token_gives_strict_json(small_context_model):
    model = small_context_model
    state = prefill(model, [[1, 2, 3]], 1)
    _, stats = decode(model, state, attention="dense", max_new_tokens=1)
    assert stats["decode_tokens_per_s"] is None
    json.loads(json.dumps(stats, allow_nan=False))


def test_sliding_window_shorter_than_the_sequence_decodes_past_it():
    """Decoding runs past a window of 8 (it stopped there before windows were computed), and a
    decode step's logits equal the full forward pass's, whose attention is windowed too."""
    model = tiny_model(0, dataclasses.replace(TINY, sliding_window=8))
    prompt = list(range(1, 12))
    state = prefill(model, [prompt], 8)
    outs, stats = decode(model, state, attention="dense", max_new_tokens=8, stop_on_eos=False)
    assert len(outs[0]) == 8 and stats["stop_reasons"] == ["length"]
    logits = forward_logits(model, prompt + outs[0][:-1])
    np.testing.assert_array_equal(logits[len(prompt) - 1:].argmax(-1), outs[0])


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("temperature", float("nan")), ("top_p", 0.0),
                                         ("top_p", 1.5), ("seed", -1)])
def test_sampling_rejects_values_out_of_range(field, value):
    with pytest.raises(ValueError, match=field):
        Sampling(**{field: value})


def test_second_sampled_call_compiles_nothing(small_context_model):
    model = small_context_model
    state = prefill(model, [[1, 2, 3]], 4)
    sampling = Sampling(temperature=0.8, top_p=0.9, seed=1)
    first, _ = decode(model, state, attention="dense", max_new_tokens=4, sampling=sampling, stop_on_eos=False)
    compiles = []

    def count(event, *args, **kwargs):
        if "backend_compile" in event or "compilation_cache" in event:  # compiled, or read from the disk cache
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        again, _ = decode(model, state, attention="dense", max_new_tokens=4, sampling=sampling, stop_on_eos=False)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert again == first
    assert compiles == []


def test_decode_takes_sampling_only_as_a_dataclass(small_context_model):
    model = small_context_model
    state = prefill(model, [[1, 2, 3]], 2)
    with pytest.raises(TypeError, match="seed"):
        decode(model, state, max_new_tokens=2, seed=1)
    assert np.isfinite(np.asarray(state.last_logits)).all()


@pytest.mark.parametrize("attention", ["dense", "magicpig"])
def test_consuming_the_prefill_decodes_the_same_tokens_without_a_copy(small_context_model, attention):
    from magicpig_jax.decode_loop import start_decode
    from magicpig_jax.generation import decode_spec

    model = small_context_model
    state = prefill(model, [list(range(1, 21)), list(range(3, 13))], 6)
    spec = decode_spec(model, attention)
    sampling = Sampling()
    copied = [start_decode(model, state, spec, 6, sampling, stop_on_eos=False) for _ in range(2)]
    for run in copied:
        for _ in run:
            pass
    prefill_v = state.cache.v[-1]
    assert not prefill_v.is_deleted()  # the copies' steps updated their own buffers
    consumed = start_decode(model, state, spec, 6, sampling, stop_on_eos=False, consume_prefill=True)
    assert state.cache is None
    for _ in consumed:
        pass
    assert prefill_v.is_deleted()  # donated to the steps: decoded in the prefill's own buffers
    assert copied[0].outputs == copied[1].outputs == consumed.outputs
    with pytest.raises(ValueError, match="cache was consumed by an earlier decode"):
        start_decode(model, state, spec, 6, sampling)
    from magicpig_jax.generation import decode  # it read the consumed cache's capacity first (AttributeError)
    with pytest.raises(ValueError, match="cache was consumed by an earlier decode"):
        decode(model, state, attention=attention, max_new_tokens=6)


def test_prefix_state_of_one_prefill_equals_prefilling_the_prefix():
    # prefill_with_prefixes (eval's setups A and B of one sample): the prefixes' cache, logits and
    # decoded tokens equal those of a prefill of the prefixes alone; the prompts' state equals prefill's.
    from magicpig_jax.generation import prefill_with_prefixes

    model = tiny_model(3)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 97, 300).tolist(), rng.integers(1, 97, 41).tolist()]
    cuts = [290, 12]  # the first crosses a 256-token chunk's end, the second stays in one chunk
    full, pre = prefill_with_prefixes(model, prompts, cuts, 8)
    alone = prefill(model, [p[:c] for p, c in zip(prompts, cuts, strict=True)], 8)
    whole = prefill(model, prompts, 8)
    np.testing.assert_array_equal(pre.prompt_lengths, cuts)
    np.testing.assert_array_equal(np.asarray(pre.cache.lengths), cuts)
    np.testing.assert_array_equal(np.asarray(full.cache.lengths), [300, 41])
    np.testing.assert_allclose(np.asarray(pre.last_logits), np.asarray(alone.last_logits), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(full.last_logits), np.asarray(whole.last_logits))
    for layer in range(TINY.num_layers):
        for b, c in enumerate(cuts):
            for got, want in ((pre.cache.k, alone.cache.k), (pre.cache.v, alone.cache.v)):
                np.testing.assert_allclose(np.asarray(got[layer])[b, :, :c], np.asarray(want[layer])[b, :, :c],
                                           atol=1e-5, rtol=0)
    # nothing reads the cached positions past a row's length: the prompts' tail there, or large
    # garbage, decodes the same tokens as the zeros of a prefill of the prefix alone
    import dataclasses as dc

    junk = np.random.default_rng(0).normal(0, 1e3, np.asarray(pre.cache.k[0]).shape).astype(np.float32)
    past = np.arange(junk.shape[2])[None, None, :, None] >= np.asarray(cuts)[:, None, None, None]
    poison = lambda a: jnp.where(past, junk, a)  # noqa: E731
    poisoned = dc.replace(pre, cache=dc.replace(pre.cache, k=tuple(map(poison, pre.cache.k)),
                                                 v=tuple(map(poison, pre.cache.v))))
    for attention, budget in (("dense", None), ("magicpig", None), ("topk", 24), ("quest", 24), ("oracle", 24)):
        kw = dict(attention=attention, budget=budget, max_new_tokens=6, stop_on_eos=False,
                  **({"page_size": 8} if attention == "quest" else {}))
        want, _ = decode(model, alone, **kw)
        for state in (pre, poisoned):
            got, _ = decode(model, state, **kw)
            assert got == want, attention
    # both states stay usable: decoding one copies the shared buffers
    again, _ = decode(model, full, attention="dense", max_new_tokens=6, stop_on_eos=False)
    ref, _ = decode(model, whole, attention="dense", max_new_tokens=6, stop_on_eos=False)
    assert again == ref
    # consuming one would delete the other's buffers (a later decode of it: "Array has been deleted")
    from magicpig_jax.decode_loop import start_decode
    from magicpig_jax.generation import decode_spec

    for state in (full, pre):
        with pytest.raises(ValueError, match="shares its cache buffers"):
            start_decode(model, state, decode_spec(model, "dense"), 6, Sampling(), consume_prefill=True)
    assert decode(model, full, attention="dense", max_new_tokens=6, stop_on_eos=False)[0] == ref
    with pytest.raises(ValueError, match=r"prefix_lengths\[1\] must be in \[1, 41\]"):
        prefill_with_prefixes(model, prompts, [290, 42], 8)
    with pytest.raises(ValueError, match="prefix_lengths has 1 entries"):
        prefill_with_prefixes(model, prompts, [3], 8)


def _run_counting(model, state, spec, n, sampling, stop=None):
    """Decode ``n`` tokens per row with ``start_decode``: (outputs, stats, the step count of each program call)."""
    from magicpig_jax.decode_loop import start_decode

    run = start_decode(model, state, spec, n, sampling, stop_on_eos=False, stop=stop)
    counts, inner = [], run.step

    def step(*args):
        counts.append(args[6])  # (leaves, cache, indices, tokens, key, t, count, ...)
        return inner(*args)

    step.max_count = inner.max_count
    run.step = step
    for _ in run:
        pass
    return run.outputs, run.stats(), counts, run


@pytest.mark.parametrize("attention", ["dense", "magicpig"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_chunks_of_steps_decode_the_tokens_of_single_steps(monkeypatch, attention, temperature):
    # One program call running up to CHUNK_MAX steps (fori_loop) must give the tokens and sampled
    # fractions of one step per call: same keys (fold_in(base_key, t)), same cache and index
    # updates, including the index appends of generated tokens (every 8 steps here).
    from magicpig_jax import decode_loop
    from magicpig_jax.attention import MagicPIGConfig
    from magicpig_jax.models.backends import DecodeSpec

    model = tiny_model(2)
    rng = np.random.default_rng(0)
    state = prefill(model, [rng.integers(1, 97, 40).tolist(), rng.integers(1, 97, 23).tolist()], 40)
    cfg = MagicPIGConfig(K=6, L=20, num_sink=2, num_local=8)
    spec = DecodeSpec(backend=attention, magicpig=cfg, dense_layers=(0,), generation_buffer=8)
    sampling = Sampling(temperature=temperature, top_p=0.9, seed=3)
    results = {}
    for name, seconds in (("single", 0.0), ("chunked", 1e9)):
        monkeypatch.setattr(decode_loop, "CHUNK_SECONDS", seconds)
        results[name] = _run_counting(model, state, spec, 40, sampling)
    single, chunked = results["single"], results["chunked"]
    assert set(single[2]) == {1}
    assert max(chunked[2]) == decode_loop.CHUNK_MAX and sum(chunked[2]) == 39  # 39 steps after token 0
    assert chunked[0] == single[0] and all(len(o) == 40 for o in chunked[0])
    assert chunked[1]["decode_steps"] == single[1]["decode_steps"] == 39
    for layer, frac in single[1]["sampled_fraction_per_layer"].items():
        assert chunked[1]["sampled_fraction_per_layer"][layer] == pytest.approx(frac, rel=1e-12)
    np.testing.assert_array_equal(np.asarray(chunked[3].cache.lengths), np.asarray(single[3].cache.lengths))


def test_a_row_stopped_inside_a_chunk_keeps_only_its_tokens(monkeypatch):
    # A stop inside a chunk: the row's outputs end at the stop, as with single steps; the steps
    # run past it are not in the outputs (the cache holds their positions: DecodeRun's docstring).
    from magicpig_jax import decode_loop
    from magicpig_jax.generation import decode_spec

    model = tiny_model(2)
    state = prefill(model, [list(range(1, 21)), list(range(5, 17))], 40)
    spec = decode_spec(model, "dense")
    stop = lambda row, ids: len(ids) == (13 if row == 0 else 27)  # noqa: E731
    results = {}
    for name, seconds in (("single", 0.0), ("chunked", 1e9)):
        monkeypatch.setattr(decode_loop, "CHUNK_SECONDS", seconds)
        results[name] = _run_counting(model, state, spec, 40, Sampling(), stop=stop)
    single, chunked = results["single"], results["chunked"]
    assert [len(o) for o in chunked[0]] == [13, 27]
    assert chunked[0] == single[0] and chunked[1]["stop_reasons"] == ["stop", "stop"]
    assert max(chunked[2]) > 1
    assert (np.asarray(chunked[3].cache.lengths) >= np.asarray([20 + 26, 12 + 26])).all()


def test_short_runs_and_hooks_compile_the_one_step_program():
    # Below CHUNK_MIN_TOKENS, or with evaluation hooks, every call runs one step.
    from magicpig_jax import decode_loop
    from magicpig_jax.decode_loop import DecodeHooks, start_decode
    from magicpig_jax.generation import decode_spec

    model = tiny_model(2)
    state = prefill(model, [list(range(1, 21))], 40)
    spec = decode_spec(model, "dense")
    n = decode_loop.CHUNK_MIN_TOKENS
    assert start_decode(model, state, spec, n - 1, Sampling()).step.max_count == 1
    assert start_decode(model, state, spec, n, Sampling()).step.max_count == decode_loop.CHUNK_MAX
    hooks = DecodeHooks(on_logits=lambda t, logits: None)
    assert start_decode(model, state, spec, n, Sampling(), hooks=hooks).step.max_count == 1


def test_sampling_takes_numpy_scalars_and_refuses_bools():
    from magicpig_jax.decode_loop import Sampling

    s = Sampling(temperature=np.float32(0.5), top_p=np.float64(0.9), seed=np.int64(3))
    assert s.temperature == 0.5 and s.top_p == 0.9
    json.dumps(dataclasses.asdict(s))  # kept as Python numbers: a run's stats are written as JSON
    from magicpig_jax.models.backends import DecodeSpec

    spec = DecodeSpec(backend="topk", budget=np.int64(32))
    assert type(spec.budget) is int and spec == DecodeSpec(backend="topk", budget=32)
    for bad in (True, np.bool_(True)):
        with pytest.raises(ValueError, match="temperature"):
            Sampling(temperature=bad)


def test_a_run_is_iterated_once():
    # a second `for` over a run restarted from the prefill's logits on the moved cache: after a break
    # at token 3 the tokens were [t0, t1, t2, t3, t0', ...] (the first token again, a later position),
    # and a finished run iterated again grew past max_new_tokens
    from magicpig_jax.decode_loop import start_decode
    from magicpig_jax.generation import decode_spec

    model = tiny_model(2)
    state = prefill(model, [list(range(3, 20))], 8)
    spec = decode_spec(model, "dense")
    whole = start_decode(model, state, spec, 8, Sampling(), stop_on_eos=False)
    for _ in whole:
        pass
    with pytest.raises(RuntimeError, match="already iterated"):
        for _ in whole:
            pass
    assert len(whole.outputs[0]) == 8
    run = start_decode(model, state, spec, 8, Sampling(), stop_on_eos=False)
    steps = iter(run)
    for i, _ in enumerate(steps):
        if i == 3:
            break
    with pytest.raises(RuntimeError, match="already iterated"):
        for _ in run:
            pass
    for _ in steps:  # the first iterator continues where it stopped
        pass
    assert run.outputs == whole.outputs
