"""SimHash projections shared by consecutive layers (MagicPIGConfig.layers_per_projection).

The matrices (equal within a group of equal configs, the default unchanged), the layers whose
decode step hashes with another layer's buffer (projection_sources), and the decode itself: the
host backend with shared buffers gives bit for bit the tokens, logits and sampled counts of the
same decode with every layer's own copy, and the tokens of the pure-JAX reference.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magicpig_jax.attention import LayerConfigs, MagicPIGConfig
from magicpig_jax.models import decoding
from magicpig_jax.models.backends import (
    DecodeSpec,
    layer_projections,
    projection_sources,
    with_shared_projections,
)


def test_config_validates_layers_per_projection():
    assert MagicPIGConfig().layers_per_projection == 1
    assert MagicPIGConfig(layers_per_projection=16).layers_per_projection == 16
    for bad in (0, -1):
        with pytest.raises(ValueError, match="layers_per_projection must be >= 1"):
            MagicPIGConfig(layers_per_projection=bad)
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match="layers_per_projection"):
            MagicPIGConfig(layers_per_projection=bad)


def test_projections_equal_within_a_group_only():
    one, four = MagicPIGConfig(K=4, L=6, seed=3), MagicPIGConfig(K=4, L=6, seed=3, layers_per_projection=4)
    # the default is the per-layer draw of before: fold_in(key(seed), layer)
    for layer in (0, 1, 5):
        want = jax.random.normal(jax.random.fold_in(jax.random.key(3), layer), (8, 24), dtype=np.float32)
        np.testing.assert_array_equal(np.asarray(layer_projections(one, layer, 8)), np.asarray(want))
    mats = [np.asarray(layer_projections(four, i, 8)) for i in range(9)]
    for i in range(9):
        for j in range(9):
            assert np.array_equal(mats[i], mats[j]) == (i // 4 == j // 4), (i, j)
    # group 0 of a shared config is layer 0's own matrix; a traced layer gives the same values
    np.testing.assert_array_equal(mats[3], np.asarray(layer_projections(one, 0, 8)))
    traced = jax.jit(lambda i: layer_projections(four, i, 8))
    np.testing.assert_array_equal(np.asarray(traced(np.int32(6))), mats[6])


def test_projection_sources():
    shared = MagicPIGConfig(K=4, L=6, layers_per_projection=4)
    assert projection_sources(DecodeSpec(backend="magicpig-ref", magicpig=MagicPIGConfig()), 8) == {}
    spec = DecodeSpec(backend="magicpig-ref", magicpig=shared, dense_layers=(0, 5))
    # groups {0..3} and {4..7}; the first sparse layer of each is the source
    assert projection_sources(spec, 8) == {2: 1, 3: 1, 6: 4, 7: 4}
    assert projection_sources(dataclasses.replace(spec, backend="dense", dense_layers=()), 8) == {}
    # under per-layer configs only layers with the same config share
    other = dataclasses.replace(shared, K=5)
    lc = LayerConfigs(((0, "dense"), (1, shared), (2, other), (3, shared), (4, other), (5, other)))
    spec = DecodeSpec(backend="magicpig-ref", magicpig=lc.base(), dense_layers=(0,), layers=lc)
    assert projection_sources(spec, 6) == {3: 1, 5: 4}


def test_with_shared_projections_checks_the_shape():
    from magicpig_jax.attention.magicpig import LSHIndex
    from magicpig_jax.models.backends import LayerState

    def index(L):
        return LSHIndex(codes=jnp.zeros((1, 1, 4, L), jnp.uint32), mean=jnp.zeros((1, 1, 3), jnp.float32),
                        start=jnp.zeros(1, jnp.int32), end=jnp.zeros(1, jnp.int32),
                        projections=jnp.full((3, 2 * L), L, jnp.float32))

    a, b = index(4), index(4)
    b = dataclasses.replace(b, projections=jnp.full((3, 8), 9.0, jnp.float32))
    assert with_shared_projections(a, b).projections is b.projections
    assert with_shared_projections(a, b).codes is a.codes
    wrapped = with_shared_projections(LayerState(a, MagicPIGConfig()), LayerState(b, MagicPIGConfig()))
    assert wrapped.state.projections is b.projections
    assert with_shared_projections(None, b) is None  # no projections: unchanged
    with pytest.raises(ValueError, match="one shape"):
        with_shared_projections(a, index(5))


def test_layer_configs_json_keeps_the_option(tmp_path):
    cfg = MagicPIGConfig(K=4, L=6, layers_per_projection=16)
    lc = LayerConfigs(((0, "dense"), (1, cfg), (2, cfg)))
    obj = lc.to_json()
    assert obj["layers_per_projection"] == 16
    assert LayerConfigs.from_json(json.loads(json.dumps(obj))) == lc
    del obj["layers_per_projection"]  # a file written before the option: one matrix per layer
    assert LayerConfigs.from_json(obj).config(1).layers_per_projection == 1
    with pytest.raises(ValueError, match="layers_per_projection"):
        LayerConfigs(((0, cfg), (1, dataclasses.replace(cfg, layers_per_projection=2))))


def _retrace() -> None:
    """Drop the cached decode steps so that the next decode traces them again."""
    from magicpig_jax import decode_loop

    decoding._STEP_CACHE.clear()
    decode_loop._FLAT_STEPS.clear()
    jax.clear_caches()


@pytest.fixture(scope="module")
def prefilled():
    from magicpig_jax.generation import prefill
    from tests._tiny import TINY, tiny_model

    config = dataclasses.replace(TINY, num_layers=6)
    model = tiny_model(0, config)
    rng = np.random.default_rng(1)
    return model, prefill(model, [list(rng.integers(1, 97, 700)), list(rng.integers(1, 97, 650))], 12)


def test_shared_buffers_decode_as_separate_copies(prefilled, monkeypatch):
    """The host decode hashing with one buffer per group equals the decode with each layer's copy."""
    from magicpig_jax.decode_loop import Sampling, run_decode
    from magicpig_jax.generation import decode_spec

    model, state = prefilled
    config = MagicPIGConfig(K=4, L=12, num_local=16, layers_per_projection=3)
    spec = decode_spec(model, "magicpig", config, [0])
    assert spec.uses_host and projection_sources(spec, 6) == {2: 1, 4: 3, 5: 3}
    _retrace()
    toks, stats = run_decode(model, state, spec, 10, Sampling())
    monkeypatch.setattr(decoding, "projection_sources", lambda spec, n: {})
    _retrace()
    own, own_stats = run_decode(model, state, spec, 10, Sampling())
    assert toks == own
    assert stats["sampled_fraction_per_layer"] == own_stats["sampled_fraction_per_layer"]
    assert min(stats["sampled_fraction_per_layer"].values()) > 0
    # a wrong source (another group's matrix) changes the sampled sets: the check can fail
    monkeypatch.setattr(decoding, "projection_sources", lambda spec, n: {2: 3, 4: 1, 5: 1})
    _retrace()
    _, wrong_stats = run_decode(model, state, spec, 10, Sampling())
    monkeypatch.undo()
    _retrace()
    assert wrong_stats["sampled_fraction_per_layer"] != stats["sampled_fraction_per_layer"]


def test_host_decode_with_shared_projections_matches_the_reference(prefilled):
    from magicpig_jax.decode_loop import Sampling, run_decode
    from magicpig_jax.generation import decode_spec

    model, state = prefilled
    config = MagicPIGConfig(K=4, L=12, num_local=16, layers_per_projection=6)
    # Three tokens (two sparse steps): the host kernel sums q·projection in another order than
    # XLA's dot (host/simhash.py), so a product within float32 rounding of 0 may hash to the other
    # bucket and the two decodes then part legitimately; on an AVX-512 machine this prompt does so
    # at the fourth token. Equal tokens and equal sampled fractions per layer over these steps
    # show the host op hashes with the reference's shared hyperplanes (another group's matrix
    # changes the fractions: test_shared_buffers_decode_as_separate_copies).
    host, host_stats = run_decode(model, state, decode_spec(model, "magicpig", config, [0]), 3, Sampling(),
                                  stop_on_eos=False)
    ref, ref_stats = run_decode(model, state, decode_spec(model, "magicpig-ref", config, [0]), 3, Sampling(),
                                stop_on_eos=False)
    assert host == ref
    assert host_stats["sampled_fraction_per_layer"] == ref_stats["sampled_fraction_per_layer"]
    host, _ = run_decode(model, state, decode_spec(model, "magicpig", config, [0]), 10, Sampling())
    per_layer, _ = run_decode(model, state, decode_spec(model, "magicpig", dataclasses.replace(
        config, layers_per_projection=1), [0]), 10, Sampling())
    assert per_layer != host  # other hyperplanes, other samples (the option is not ignored)


def test_cli_rejects_a_bad_value(tmp_path):
    from tests.test_cli import one_line_error, run

    for cmd in (["generate", "--prompt", "Hi"], ["bench", "decode"], ["eval", "--out", str(tmp_path / "eval")],
                ["calibrate", "--kl-budget", "0.01", "--out", str(tmp_path / "c.json")]):
        one_line_error(run(*cmd, "--layers-per-projection", "0"), "--layers-per-projection must be >= 1")
    assert not (tmp_path / "eval").exists() and not (tmp_path / "c.json").exists()


def _steps(model, state, build_spec, step_spec, steps=6):
    """Greedy tokens [B, steps] and sampled counts of a decode built with one spec and stepped with another."""
    from flax import nnx

    cache = state.cache.copy()
    graphdef, params = nnx.split(model.module)
    indices = decoding.build_indices(cache, build_spec, model.config.num_layers)
    tokens = jnp.argmax(state.last_logits, -1).astype(jnp.int32)
    toks, counts = [], []
    for _ in range(steps):
        tokens, _, n, cache, indices = decoding.decode_step(graphdef, params, cache, indices, tokens,
                                                            jax.random.key(0), jnp.float32(0), jnp.float32(1),
                                                            spec=step_spec)
        toks.append(np.asarray(tokens))
        counts.append(np.asarray(n))
    return np.stack(toks, 1), np.stack(counts), indices


@pytest.mark.parametrize("backend", ["magicpig", "magicpig-ref"])
def test_a_group_holds_one_matrix_and_records_its_source(prefilled, backend):
    """build_indices keeps one [D, K*L] matrix per group; the others hold an empty [D, 0] and their source."""
    from magicpig_jax.generation import decode_spec
    from magicpig_jax.models.backends import SharedProjections

    model, state = prefilled
    config = MagicPIGConfig(K=4, L=12, num_local=16, layers_per_projection=3)
    spec = decode_spec(model, "magicpig", config, [0])
    spec = dataclasses.replace(spec, backend=backend)
    _, _, indices = _steps(model, state, spec, spec, steps=2)  # after steps: appends keep the layout
    D = model.config.head_dim
    assert indices[0] is None
    for i, source in {2: 1, 4: 3, 5: 3}.items():
        assert isinstance(indices[i], SharedProjections) and indices[i].source == source
        assert indices[i].state.projections.shape == (D, 0)
    for i in (1, 3):
        np.testing.assert_array_equal(np.asarray(indices[i].projections),
                                      np.asarray(layer_projections(config, i, D)))


def test_the_decode_hashes_with_the_build_matrices_whatever_the_step_spec(prefilled):
    """Indices built with one grouping and stepped with a spec of another grouping decode as the build's spec.

    Before the source was recorded in the state, the step took the groups from its own spec: a
    build with one matrix per layer stepped with layers_per_projection = 3 hashed the queries of
    layers 2, 4, 5 with other layers' matrices, a silent wrong sample.
    """
    from magicpig_jax.generation import decode_spec

    model, state = prefilled
    base = MagicPIGConfig(K=4, L=12, num_local=16)
    own = decode_spec(model, "magicpig", base, [0])
    grouped = decode_spec(model, "magicpig", dataclasses.replace(base, layers_per_projection=3), [0])
    for build in (own, grouped):
        want, want_n, _ = _steps(model, state, build, build)
        for step in (own, grouped):
            got, got_n, _ = _steps(model, state, build, step)
            np.testing.assert_array_equal(got, want)
            np.testing.assert_array_equal(got_n, want_n)
    # the two builds differ (other hyperplanes): the comparison above can fail
    assert not np.array_equal(_steps(model, state, own, own)[1], _steps(model, state, grouped, grouped)[1])


def test_resolve_projections_refuses_a_source_without_its_matrix():
    from magicpig_jax.attention.magicpig import LSHIndex
    from magicpig_jax.models.backends import SharedProjections, drop_projections, resolve_projections

    index = LSHIndex(codes=jnp.zeros((1, 1, 4, 2), jnp.uint32), mean=jnp.zeros((1, 1, 3), jnp.float32),
                     start=jnp.zeros(1, jnp.int32), end=jnp.zeros(1, jnp.int32),
                     projections=jnp.ones((3, 8), jnp.float32))
    dropped = drop_projections(index)
    assert dropped.projections.shape == (3, 0) and dropped.codes is index.codes
    shared = SharedProjections(dropped, 0)
    assert resolve_projections((index, shared), 1).projections is index.projections
    assert resolve_projections((index, shared), 0) is index
    for states in ((dropped, shared), (shared, shared), (None, shared)):
        with pytest.raises(ValueError, match="projections"):
            resolve_projections(states, 1)


def test_the_chunked_decode_loop_keeps_the_shared_layout(prefilled, monkeypatch):
    """Past CHUNK_MIN_TOKENS the decode runs chunks of steps in one program (a loop carrying the
    SharedProjections states): sampled tokens and counts equal the decode with every layer's copy."""
    from magicpig_jax.decode_loop import CHUNK_MIN_TOKENS, Sampling, run_decode
    from magicpig_jax.generation import decode_spec

    model, state = prefilled
    n = CHUNK_MIN_TOKENS + 8
    sampling = Sampling(temperature=0.8, seed=3)
    for backend in ("magicpig", "magicpig-ref"):
        spec = dataclasses.replace(decode_spec(model, "magicpig", MagicPIGConfig(
            K=4, L=12, num_local=16, layers_per_projection=3), [0]), backend=backend)
        _retrace()
        toks, stats = run_decode(model, state, spec, n, sampling, stop_on_eos=False)
        monkeypatch.setattr(decoding, "projection_sources", lambda spec, n: {})
        _retrace()
        own, own_stats = run_decode(model, state, spec, n, sampling, stop_on_eos=False)
        monkeypatch.undo()
        assert all(len(t) == n for t in toks) and toks == own, backend
        assert stats["sampled_fraction_per_layer"] == own_stats["sampled_fraction_per_layer"], backend
    _retrace()
