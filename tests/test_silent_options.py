"""Options and inputs that were accepted and then ignored or mishandled are refused, naming them.

A host device without the offload decoder, a heavy threshold outside the hybrid backend, a
budget for a backend that takes none, a seed that ``jax.random.key`` would fold onto a smaller
one, a float ``max_new_tokens``, an eval whose ``--out`` an invalid setting would have written,
and a ``magicpig@FILE`` whose file changed since its results were recorded.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from magicpig_jax.attention import HybridConfig, LayerConfigs, MagicPIGConfig
from magicpig_jax.decode_loop import Sampling
from magicpig_jax.eval.methods import Method, parse_methods
from magicpig_jax.eval.run import run_eval
from magicpig_jax.generation import decode_spec, generate
from magicpig_jax.models.backends import DecodeSpec
from tests._tiny import tiny_model
from tests.test_eval_run import _settings, char_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)


def test_a_host_device_needs_the_offload_decoder():
    """host_device is the offload decoder's; on a spec that does not offload it was ignored."""
    cpu = jax.devices("cpu")[0]
    for kwargs in ({"offload": False}, {"backend": "dense"}):
        spec = {"backend": "magicpig"} | kwargs
        with pytest.raises(ValueError, match=r"host_device applies to the offload decoder only \(offload=True\)"):
            DecodeSpec(**spec, host_device=cpu)
    assert DecodeSpec(backend="magicpig", offload=True, host_device=cpu).host_device == cpu


def test_host_offload_and_host_device_are_type_checked(monkeypatch):
    """A string host_device raised AttributeError ('str' object has no attribute 'platform'), and
    any truthy offload ('no') or host switched the offload decoder or host op on."""
    for bad in ("cpu", 1):
        with pytest.raises(TypeError, match="host_device must be a jax.Device"):
            DecodeSpec(backend="magicpig", offload=True, host_device=bad)
    for name in ("offload", "host"):
        for bad in ("no", 0, 1.0):
            with pytest.raises(TypeError, match=f"{name} must be a bool or None"):
                DecodeSpec(backend="magicpig", **{name: bad})


def test_host_false_is_pure_jax_even_where_offload_is_the_default(monkeypatch):
    """host=False was ignored by the offload decoder, which runs the host op."""
    with pytest.raises(ValueError, match="drop one of host=False and offload=True"):
        DecodeSpec(backend="magicpig", host=False, offload=True)
    import magicpig_jax.models.backends.spec as spec_module

    monkeypatch.setattr(spec_module, "host_ops_by_default", lambda: False)  # a GPU or TPU backend
    default = DecodeSpec(backend="magicpig")
    assert (default.offload, default.host, default.uses_host) == (True, None, False)
    assert default.with_softcap(50.0).offload  # a resolved spec replaces cleanly (the offload decoder does)
    assert DecodeSpec(backend="magicpig", offload=True).with_softcap(30.0).logit_softcap == 30.0
    off = dataclasses.replace(default, offload=False)  # as a fresh spec with offload=False: pure JAX here
    assert (off.host, off.uses_host) == (False, False) == (DecodeSpec(backend="magicpig", offload=False).host, False)
    assert DecodeSpec(backend="magicpig", host=np.True_, generation_buffer=np.int64(64)).generation_buffer == 64
    spec = DecodeSpec(backend="magicpig", host=False)
    assert (spec.offload, spec.host, spec.uses_host) == (False, False, False)


def test_a_heavy_threshold_needs_the_hybrid_backend(model):
    hy = HybridConfig(K=4, L=12, heavy=3, num_local=16)
    for backend in ("magicpig", "magicpig-ref", "dense", "topk"):
        with pytest.raises(ValueError, match=f"heavy threshold .* backend '{backend}' would ignore it"):
            DecodeSpec(backend=backend, magicpig=hy, budget=8 if backend == "topk" else None)
    per_layer = LayerConfigs(((0, "dense"), (1, hy), (2, hy)))
    for backend in ("magicpig", "magicpig-ref"):
        with pytest.raises(ValueError, match="heavy threshold"):
            decode_spec(model, backend, per_layer)
    assert decode_spec(model, "hybrid", per_layer).layers == per_layer
    assert decode_spec(model, "hybrid", hy).magicpig == hy
    # no config: the hybrid backend gets the default HybridConfig (a plain MagicPIGConfig, which it
    # refuses, made generate(attention="hybrid") fail whatever the prompt)
    assert decode_spec(model, "hybrid").magicpig == HybridConfig()
    out = generate(char_model(), "abc", attention="hybrid", max_new_tokens=2, chat=False)
    assert out.stats["attention"] == "hybrid"


def test_a_generation_buffer_keeps_the_static_window_an_int32():
    with pytest.raises(ValueError, match=r"generation_buffer must be in \[1, 2\*\*29\]"):
        DecodeSpec(backend="magicpig", generation_buffer=2**30)
    assert DecodeSpec(backend="magicpig", generation_buffer=2**29).static_window == 64 + 2**30


def test_a_budget_only_for_the_budgeted_backends(model):
    for attention in ("dense", "magicpig", "magicpig-ref", "hybrid"):
        with pytest.raises(ValueError, match="budget applies to the topk, quest, oracle backends only"):
            decode_spec(model, attention, budget=5)
    with pytest.raises(ValueError, match="budget applies"):  # before the prefill
        generate(model, [1, 2, 3], attention="magicpig", budget=5, max_new_tokens=2, chat=False)
    assert decode_spec(model, "topk", budget=5).budget == 5


def test_seeds_are_32_bit():
    for make in (lambda s: MagicPIGConfig(seed=s), lambda s: Sampling(seed=s)):
        make(2**32 - 1)
        for bad in (2**32, 2**32 + 5, 2**64):
            with pytest.raises(ValueError, match=r"seed must be"):
                make(bad)


def test_generate_checks_max_new_tokens_first(model):
    for bad, err, match in ((2.5, TypeError, "max_new_tokens must be an int, got 2.5"),
                            (True, TypeError, "max_new_tokens must be an int"),
                            (0, ValueError, "max_new_tokens must be >= 1, got 0"),
                            (-1, ValueError, "max_new_tokens must be >= 1, got -1")):
        with pytest.raises(err, match=match):
            generate(model, [1, 2, 3], attention="dense", max_new_tokens=bad, chat=False)


def test_build_indices_checks_num_layers(model):
    from magicpig_jax.generation import prefill
    from magicpig_jax.models.decoding import build_indices

    state = prefill(model, [[1, 2, 3, 4]], 2)
    spec = decode_spec(model, "magicpig-ref", MagicPIGConfig(K=4, L=8, num_local=1))
    for bad in (2, 5):
        with pytest.raises(ValueError, match=f"num_layers must be the cache's layer count 3, got {bad}"):
            build_indices(state.cache, spec, bad)


@pytest.mark.parametrize("change,match", [
    (dict(num_sink=-1), "num_sink must be >= 0"),
    (dict(dense_layers=[99]), r"dense_layers must be in \[0, 3\)"),
    # (built by hand: parse_methods itself refuses K = 17 for the host index)
    (dict(methods=[Method("dense", "dense"), Method("magicpig:17x150", "magicpig", K=17, L=150)],
          budget_from="magicpig:17x150"), "K must be in|the host index takes K in"),
    (dict(lengths=[10**6]), "exceeds the model's context"),
])
def test_invalid_eval_settings_write_nothing(tmp_path, change, match):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=match):
        run_eval(char_model(), _settings(**change), out, progress=False)
    assert not out.exists()


def test_a_changed_config_file_is_refused(tmp_path):
    model = char_model()
    path = tmp_path / "cfg.json"
    cfg = MagicPIGConfig(K=4, L=8)
    LayerConfigs(((0, "dense"), (1, cfg), (2, cfg))).save(path)
    settings = _settings(tasks=[], methods=parse_methods(f"dense,magicpig@{path}", "magicpig:4x8"),
                         likelihood_tokens=4, setups=["A"])
    out = tmp_path / "run"
    store = run_eval(model, settings, out, progress=False)
    assert {r["method"] for r in store.records.values()} == {"dense", "magicpig@cfg"}
    again: list[dict] = []
    run_eval(model, settings, out, on_record=again.append, progress=False)
    assert again == []  # the same file: nothing to do
    LayerConfigs(((0, "dense"), (1, dataclasses.replace(cfg, L=6)), (2, "dense"))).save(path)
    with pytest.raises(ValueError, match=r"cfg.json \(sha1 \w+\) is not the file .* recorded magicpig@cfg with"):
        run_eval(model, settings, out, progress=False)


def test_decode_spec_refuses_a_budget_it_would_ignore():
    for backend in ("dense", "magicpig", "magicpig-ref"):
        with pytest.raises(ValueError, match="budget applies to the topk, quest, oracle backends only"):
            DecodeSpec(backend=backend, budget=-5)


def test_the_reference_names_a_wrong_config_or_index():
    import jax.numpy as jnp

    from magicpig_jax.attention import build_lsh_index, magicpig_attention
    from magicpig_jax.lsh import simhash_projections

    cfg = MagicPIGConfig(K=4, L=8, num_sink=1, num_local=2)
    k = jnp.ones((1, 1, 16, 8), jnp.float32)
    q = jnp.ones((1, 2, 8), jnp.float32)
    import jax

    index = build_lsh_index(k, simhash_projections(jax.random.key(0), 8, 4, 8), cfg)
    # ours, or jaxtyping's in the suite (it checks the annotations first); both name the parameter
    with pytest.raises(TypeError, match="config"):
        magicpig_attention(q, k, k, index, {"K": 4})
    with pytest.raises(TypeError, match="index"):
        magicpig_attention(q, k, k, {"codes": index.codes}, cfg)


def test_a_step_with_more_sparse_layers_than_the_build_names_them(model):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from magicpig_jax.generation import prefill
    from magicpig_jax.models.decoding import build_indices, decode_step

    state = prefill(model, [list(range(1, 60))], 2)
    cfg = MagicPIGConfig(K=4, L=8, num_local=4)
    built = decode_spec(model, "magicpig-ref", cfg, [0])
    indices = build_indices(state.cache, built, 3)
    graphdef, params = nnx.split(model.module)
    with pytest.raises(ValueError, match=r"layers \[0\] are sparse in the step's spec but have no index"):
        decode_step(graphdef, params, state.cache.copy(), indices, jnp.zeros((1,), jnp.int32), jax.random.key(0),
                    jnp.float32(0), jnp.float32(1), spec=decode_spec(model, "magicpig-ref", cfg, []))
