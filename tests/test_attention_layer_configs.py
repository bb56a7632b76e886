"""Per-layer MagicPIG configurations (magicpig_jax.attention.LayerConfigs): validation, hashing, the
JSON file, and decoding with them (each layer's state built with its own K and L; one config for
every layer decodes as the plain spec)."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

from magicpig_jax.attention import HybridConfig, LayerConfigs, MagicPIGConfig
from magicpig_jax.attention.layer_configs import FORMAT


def test_validation_and_hash():
    a, b = MagicPIGConfig(K=8, L=75), MagicPIGConfig(K=10, L=150)
    lc = LayerConfigs(((2, a), (0, "dense"), (1, b)))
    assert lc.layers[0] == (0, "dense") and lc.dense_layers == (0,) and lc.sparse_layers == (1, 2)
    assert lc.base() == b and lc.config(2) == a
    assert hash(lc) == hash(LayerConfigs(((0, "dense"), (1, b), (2, a))))
    assert LayerConfigs.uniform(b, 3, [0]) == LayerConfigs(((0, "dense"), (1, b), (2, b)))
    with pytest.raises(ValueError, match="every layer"):
        LayerConfigs(((0, a), (2, b)))
    with pytest.raises(ValueError, match="at least one"):
        LayerConfigs(())
    with pytest.raises(TypeError, match="MagicPIGConfig or 'dense'"):
        LayerConfigs(((0, "sparse"),))
    with pytest.raises(ValueError, match="share num_sink"):
        LayerConfigs(((0, a), (1, MagicPIGConfig(num_local=8))))
    with pytest.raises(ValueError, match="has 4"):
        lc.check_num_layers(4)


def test_json_round_trip(tmp_path):
    lc = LayerConfigs(((0, "dense"), (1, MagicPIGConfig(K=9, L=120, num_local=32, seed=3)),
                       (2, MagicPIGConfig(K=11, L=300, num_local=32, seed=3))), info=(("model", "tiny"),))
    path = lc.save(tmp_path / "cfg.json", extra={"kl_budget": 0.01})
    obj = json.loads(path.read_text())
    assert obj["format"] == FORMAT and obj["layers"]["1"] == {"K": 9, "L": 120} and obj["kl_budget"] == 0.01
    assert obj["num_local"] == 32 and obj["seed"] == 3
    assert LayerConfigs.load(path) == lc
    hy = LayerConfigs(((0, HybridConfig(K=4, L=10, heavy=5)),))
    assert LayerConfigs.from_json(hy.to_json()) == hy
    bad = dict(obj, layers={"0": {"K": 40, "L": 2}})
    with pytest.raises(ValueError, match="invalid entry"):
        LayerConfigs.from_json(bad)
    # a bad file-wide field is the file's, not blamed on a layer's entry
    with pytest.raises(ValueError, match=r"^layer-configs file: num_sink must be >= 0, got num_sink=-1$"):
        LayerConfigs.from_json(dict(obj, num_sink=-1))
    with pytest.raises(ValueError, match="format"):
        LayerConfigs.from_json({"layers": {}})
    (tmp_path / "neg.json").write_text(json.dumps(dict(obj, num_sink=-1)))
    with pytest.raises(ValueError, match="^" + re.escape(
            f"layer-configs file {tmp_path / 'neg.json'}: num_sink must be >= 0, got num_sink=-1") + "$"):
        LayerConfigs.load(tmp_path / "neg.json")
    (tmp_path / "x.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        LayerConfigs.load(tmp_path / "x.json")
    with pytest.raises(FileNotFoundError):
        LayerConfigs.load(tmp_path / "none.json")


def test_decode_spec_checks_the_layers():
    from magicpig_jax.models.backends import DecodeSpec

    a = MagicPIGConfig(K=4, L=10)
    lc = LayerConfigs(((0, "dense"), (1, a), (2, a)))
    spec = DecodeSpec(backend="magicpig-ref", magicpig=a, dense_layers=(0,), layers=lc)
    assert hash(spec) == hash(dataclasses.replace(spec))
    with pytest.raises(ValueError, match="dense_layers"):
        DecodeSpec(backend="magicpig-ref", magicpig=a, dense_layers=(), layers=lc)
    with pytest.raises(ValueError, match="backends"):
        DecodeSpec(backend="topk", magicpig=a, dense_layers=(0,), budget=4, layers=lc)
    with pytest.raises(ValueError, match="HybridConfig"):
        DecodeSpec(backend="hybrid", magicpig=a, dense_layers=(0,), layers=lc)


@pytest.mark.parametrize("backend", ["magicpig", "magicpig-ref"])
def test_decode_with_per_layer_configs(backend):
    from magicpig_jax.decode_loop import Sampling, run_decode
    from magicpig_jax.generation import decode_spec, prefill
    from magicpig_jax.models.backends import LayerState, backend_for
    from magicpig_jax.models.decoding import build_indices
    from tests._tiny import tiny_model

    model = tiny_model(0)
    rng = np.random.default_rng(0)
    state = prefill(model, [list(rng.integers(1, 97, 500))], 12)
    a, b = MagicPIGConfig(K=4, L=10, num_local=16), MagicPIGConfig(K=6, L=24, num_local=16)
    mixed = LayerConfigs(((0, "dense"), (1, a), (2, b)))
    spec = decode_spec(model, backend, mixed)
    assert spec.layers == mixed and spec.dense_layers == (0,) and "per-layer" in backend_for(spec).name
    states = build_indices(state.cache, spec, 3)
    assert states[0] is None and isinstance(states[1], LayerState)
    assert (states[1].config, states[2].config) == (a, b)
    shape_l = (lambda s: s.L) if backend == "magicpig" else (lambda s: s.codes.shape[-1])
    assert (shape_l(states[1].state), shape_l(states[2].state)) == (10, 24)
    out, stats = run_decode(model, state, spec, 12, Sampling())
    assert set(stats["sampled_fraction_per_layer"]) == {1, 2}
    # one config everywhere: the same tokens as the plain spec
    uniform = decode_spec(model, backend, LayerConfigs.uniform(a, 3, [0]))
    plain = decode_spec(model, backend, a, [0])
    assert run_decode(model, state, uniform, 12, Sampling())[0] == run_decode(model, state, plain, 12, Sampling())[0]


def test_json_refuses_what_it_would_otherwise_drop_or_truncate():
    """Non-integers, unknown layer fields, a misspelled field and a bad info: refused, naming them."""
    base = LayerConfigs(((0, "dense"), (1, MagicPIGConfig(K=9, L=120)))).to_json()

    def refused(match, **changes):
        with pytest.raises(ValueError, match=match):
            LayerConfigs.from_json({**base, **changes})

    for bad in (10.9, 10.0, "10", True, 1e400, None):
        refused(r"layer 1 'K' must be an integer", layers={"0": "dense", "1": {"K": bad, "L": 120}})
    for field in ("num_sink", "num_local", "seed", "layers_per_projection"):
        for bad in (4.7, True, "4"):
            refused(f"'{field}' must be an integer", **{field: bad})
    refused(r"layer 1 has unknown fields \['num_local'\]",
            layers={"0": "dense", "1": {"K": 9, "L": 120, "num_local": 0}})
    refused(r"unknown field 'layers_per_projections' \(did you mean 'layers_per_projection'\?\)",
            layers_per_projections=16)
    for bad in ([1, 2], "calibrated", None, [], 0, False, "", {"a": 1}, {"b": None}):  # none read as no notes
        refused("'info' must be an object of strings", info=bad)
    assert LayerConfigs.from_json({**base, "info": {"model": "tiny"}}).info == (("model", "tiny"),)
    refused("seed must be < 2\\*\\*32", seed=2**32)
    # the calibration's report keys are kept in the file and not read
    assert LayerConfigs.from_json({**base, "kl_budget": 0.01, "per_layer": [1]}) == LayerConfigs.from_json(base)
    assert LayerConfigs.from_json(base).config(1) == MagicPIGConfig(K=9, L=120)


def test_info_is_string_pairs():
    lc = LayerConfigs(((0, "dense"),), info={"model": "tiny"})
    assert lc.info == (("model", "tiny"),) and hash(lc) == hash(LayerConfigs(((0, "dense"),), (("model", "tiny"),)))
    for bad in ({"a": {"b": 1}}, (("a", 1),), "model"):
        with pytest.raises(TypeError, match="info"):  # ours, or jaxtyping's (the suite checks the annotations)
            LayerConfigs(((0, "dense"),), info=bad)


def test_a_non_utf8_file_names_itself(tmp_path):
    path = tmp_path / "latin1.json"
    path.write_bytes(b'{"format": "caf\xe9"}')
    with pytest.raises(ValueError, match=f"layer-configs file {path} is not JSON"):
        LayerConfigs.load(path)


def test_an_unreadable_number_names_the_file(tmp_path):
    path = tmp_path / "bigint.json"
    path.write_text('{"format": ' + "9" * 5000 + "}")  # past Python's int-string conversion limit
    with pytest.raises(ValueError, match=f"layer-configs file {path} cannot be read as JSON"):
        LayerConfigs.load(path)


TINY_SHAPE = {"num_layers": 3, "hidden_size": 32, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "vocab_size": 97}


def test_a_file_records_its_model_and_refuses_another(tmp_path):
    """A calibrated file applied to another model was decoded silently whenever the layer counts
    agreed; it records the model's sizes, which every entry point checks."""
    a = MagicPIGConfig(K=4, L=10)
    lc = LayerConfigs(((0, "dense"), (1, a), (2, a)), model_shape=TINY_SHAPE)
    back = LayerConfigs.load(lc.save(tmp_path / "cfg.json"))
    assert back == lc and dict(back.model_shape) == TINY_SHAPE
    lc.check_model(TINY_SHAPE)
    with pytest.raises(ValueError, match=re.escape("calibrated for a model of other sizes: head_dim 16 (this "
                                                   "model: 64), vocab_size 97 (this model: 49152)")):
        lc.check_model(dict(TINY_SHAPE, head_dim=64, vocab_size=49152))
    with pytest.raises(ValueError, match="the model has 30"):
        lc.check_model(dict(TINY_SHAPE, num_layers=30))
    LayerConfigs(lc.layers).check_model(dict(TINY_SHAPE, head_dim=64))  # a file from before: layers only
    assert hash(LayerConfigs(lc.layers)) == hash(lc)  # the sizes do not change the computation
    with pytest.raises(ValueError, match=r"check_model: shape lacks \['hidden_size', 'num_heads'"):
        lc.check_model({"num_layers": 3})  # the other five sizes passed unchecked
    for bad in (-1, 3, True):  # -1 returned the last layer's entry
        with pytest.raises(IndexError, match=r"layer must be an int in \[0, 3\)"):
            lc.config(bad)
    with pytest.raises(ValueError, match=r"extra keys \['layers'\] are the configs' own fields"):
        lc.save(tmp_path / "clash.json", extra={"layers": {}})  # it was dropped without a word
    with pytest.raises(ValueError, match=r"unknown keys \['heads'\]"):
        LayerConfigs(lc.layers, model_shape={"heads": 4})
    with pytest.raises(ValueError, match="gives 5 layers, the configs 3"):
        LayerConfigs(lc.layers, model_shape=dict(TINY_SHAPE, num_layers=5))
    with pytest.raises(ValueError, match=">= 1"):
        LayerConfigs(lc.layers, model_shape=dict(TINY_SHAPE, head_dim=0))
    with pytest.raises(ValueError, match=re.escape("model_shape lacks hidden_size, num_heads, num_kv_heads, head_dim, "
                                                   "vocab_size (it gives every one of")):
        LayerConfigs(lc.layers, model_shape={"num_layers": 3})  # a partial shape checked only the layers
    with pytest.raises(ValueError, match="model_shape 'head_dim' must be an integer"):
        LayerConfigs.from_json(dict(lc.to_json(), model_shape={"head_dim": 16.0}))

    from magicpig_jax.generation import decode_spec
    from tests._tiny import tiny_model

    model = tiny_model(0)
    assert model.config.model_shape() == TINY_SHAPE
    decode_spec(model, "magicpig-ref", lc, None, None, 16, positions=1)
    other = LayerConfigs(lc.layers, model_shape=dict(TINY_SHAPE, num_kv_heads=4))
    with pytest.raises(ValueError, match=re.escape("num_kv_heads 4 (this model: 2)")):
        decode_spec(model, "magicpig-ref", other, None, None, 16, positions=1)


def test_load_refuses_duplicate_keys_deep_nesting_and_directories(tmp_path):
    obj = LayerConfigs(((0, "dense"), (1, MagicPIGConfig()))).to_json()
    text = json.dumps(obj).replace('"1": {"K": 10, "L": 150}', '"1": {"K": 10, "L": 150}, "1": "dense"')
    assert text.count('"1"') == 2
    (tmp_path / "dup.json").write_text(text)
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'dup.json'} gives key '1' twice in one object")):
        LayerConfigs.load(tmp_path / "dup.json")  # json alone keeps the last: layer 1 silently dense
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match="nested too deeply"):
        LayerConfigs.load(tmp_path / "deep.json")
    with pytest.raises(ValueError, match=re.escape(f"layer-configs file {tmp_path} is a directory")):
        LayerConfigs.load(tmp_path)
    with pytest.raises(ValueError, match=re.escape("L must be <= 65536")):
        MagicPIGConfig(L=65537)
    for key, value in (("K", 12), ("dense_layers", [0, 15]), ("heavy", 4), ("dense-layers", [1]), ("k", 9),
                       ("Dense_layers", [1]), ("dense", [1]), ("Heavy", 4), ("dense_layer", [1])):  # ignored before
        with pytest.raises(ValueError, match=f"a top-level '{key}' is not read"):
            LayerConfigs.from_json(dict(obj, **{key: value}))
    for empty in (None, [], 0, "", False):  # each switched the model check off
        with pytest.raises(ValueError, match="'model_shape' must be an object"):
            LayerConfigs.from_json(dict(obj, model_shape=empty))
    pairs = [("num_layers", 2), ["head_dim", 64], ("hidden_size", 8), ("num_heads", 2), ("num_kv_heads", 1),
             ("vocab_size", 9)]
    assert dict(LayerConfigs(LayerConfigs.from_json(obj).layers, model_shape=pairs).model_shape) == dict(pairs)
    with pytest.raises(ValueError, match=re.escape("unknown field 'Seed' (did you mean 'seed'?)")):
        LayerConfigs.from_json(dict(obj, Seed=5))
    for key in ("local_window", "layer_config", "bogus"):  # were ignored: no near spelling of a field
        with pytest.raises(ValueError, match=re.escape(f"layer-configs: unknown top-level key '{key}': a file gives "
                                                       "format, num_sink,")):
            LayerConfigs.from_json(dict(obj, **{key: 1}))
    with pytest.raises(ValueError, match=re.escape("save: extra keys ['bogus'] are not report keys")):
        LayerConfigs.from_json(obj).save(tmp_path / "never.json", extra={"kl_budget": 0.1, "bogus": 1})
    assert not (tmp_path / "never.json").exists()


def test_the_command_line_checks_a_file_before_loading_the_model(tmp_path, capsys):
    from magicpig_jax import cli

    wide = LayerConfigs.uniform(MagicPIGConfig(K=10, L=5000), 30, [0, 15]).save(tmp_path / "wide.json")
    assert cli.main(["generate", "--prompt", "hi", "--magicpig-config", str(wide)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"magicpig-jax: error: generate: --magicpig-config {wide}: layer 1 has L = 5000; "
                   "attention 'magicpig' (the host index) takes L in [2, 4096], 'magicpig-ref' (pure JAX) up to 65536")
    shape = {"num_layers": 30, "hidden_size": 576, "num_heads": 9, "num_kv_heads": 3, "head_dim": 16,
             "vocab_size": 49152}
    other = LayerConfigs(LayerConfigs.uniform(MagicPIGConfig(), 30, [0, 15]).layers, model_shape=shape)
    path = other.save(tmp_path / "other.json")
    assert cli.main(["generate", "--prompt", "hi", "--magicpig-config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"magicpig-jax: error: generate: --magicpig-config {path}: the layer configs were "
                   "calibrated for a model of other sizes: head_dim 16 (this model: 64)")
    # a heavy threshold only the hybrid reads: refused before the load (it was refused after it)
    heavy = LayerConfigs.uniform(HybridConfig(K=10, L=150, heavy=8), 30, [0, 15]).save(tmp_path / "heavy.json")
    for attention in ("magicpig", "dense,magicpig-ref"):
        assert cli.main(["generate", "--prompt", "hi", "--attention", attention, "--magicpig-config",
                         str(heavy)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"magicpig-jax: error: generate: --magicpig-config {heavy}: layer 1 gives a heavy threshold, "
                       f"which only attention 'hybrid' reads; '{attention.split(',')[-1]}' would ignore it")
    # eval's magicpig@FILE: the host index's range, from the file, before the load
    wide_k = LayerConfigs.uniform(MagicPIGConfig(K=17, L=150), 30, [0, 15]).save(tmp_path / "widek.json")
    assert cli.main(["eval", "--out", str(tmp_path / "never"), "--methods", f"dense,magicpig@{wide_k}"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"magicpig-jax: error: eval: method 'magicpig@{wide_k}': layer 1: the host index takes K in [1, 16] and L in "
        "[2, 4096], got K=17, L=150")
    assert not (tmp_path / "never").exists()


def test_an_all_dense_file_keeps_its_static_set(tmp_path):
    """calibrate's all-dense result recorded the default static set (4, 64, seed 0), not the one it
    calibrated with (its own 'calibration' record said 8, 32, seed 7): the file contradicted itself."""
    from magicpig_jax.eval.calibrate import to_layer_configs

    base = MagicPIGConfig(num_sink=8, num_local=32, seed=7, layers_per_projection=2)
    lc = to_layer_configs(["dense", "dense"], base)
    want = {"num_sink": 8, "num_local": 32, "seed": 7, "layers_per_projection": 2}
    assert {k: lc.to_json()[k] for k in want} == want
    back = LayerConfigs.load(lc.save(tmp_path / "d.json"))
    assert {k: getattr(back.base(), k) for k in want} == want
    assert LayerConfigs.uniform(base, 2, [0, 1]).base().num_local == 32
    with pytest.raises(ValueError, match=r"static gives num_sink, num_local, seed, layers_per_projection \(8, 32, 7, "
                                         r"2\), the sparse layers \(4, 64, 0, 1\)"):
        LayerConfigs(((0, MagicPIGConfig()), (1, "dense")), static=base)


def test_layers_of_the_wrong_form_and_a_dense_uniform_config_are_named():
    """None, a dict or triples raised unpacking errors; uniform('dense', n) blamed 'static'."""
    from tests._messages import without_jaxtyping

    c = MagicPIGConfig()
    with without_jaxtyping():  # the suite's hook refuses these first; a user has none
        for bad in (None, {0: c}, ((0, c, 1),), "dense"):
            with pytest.raises(TypeError, match=r"layers must be a sequence of \(layer index, MagicPIGConfig or "
                                                "'dense'\\)"):
                LayerConfigs(bad)
        with pytest.raises(TypeError, match="config must be a MagicPIGConfig"):
            LayerConfigs.uniform("dense", 3)
