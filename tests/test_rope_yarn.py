"""YaRN RoPE scaling (Qwen2.5/Qwen3 long context) against transformers.

``fixtures/families/rope_yarn.json`` holds transformers' own YaRN frequencies and attention
factor for a setting of every YaRN field, and ``qwen2_yarn_rope_logits.npz`` its logits of the
Qwen2 fixture under YaRN (``fixtures/make_families.py yarn``, run by hand with torch).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from magicpig_jax.io.loader import load_model, read_model_config
from magicpig_jax.models.config import LlamaConfig
from magicpig_jax.models.rope import rope_attention_factor, rope_inv_freq
from tests.fixtures.gguf_convert import write_gguf
from tests.test_io_families import FIXTURES, TOLERANCE, _edited_copy, _max_dlogit

CASES = json.loads((FIXTURES / "rope_yarn.json").read_text())["cases"]


def _config(case) -> LlamaConfig:
    D = case["head_dim"]
    return LlamaConfig.from_hf_config({
        "model_type": "qwen2", "vocab_size": 32, "hidden_size": 4 * D, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": D,
        "max_position_embeddings": case["max_position_embeddings"], "rms_norm_eps": 1e-6,
        "rope_parameters": case["rope_parameters"]})


@pytest.mark.parametrize("case", CASES, ids=[json.dumps(c["rope_parameters"]) for c in CASES])
def test_frequencies_and_attention_factor_equal_transformers(case):
    config = _config(case)
    # transformers takes the powers in float32 (a few ulps), this package in float64 then rounds
    np.testing.assert_allclose(rope_inv_freq(config), case["inv_freq"], rtol=1e-6)
    assert rope_attention_factor(config) == pytest.approx(case["attention_factor"], rel=1e-12)
    # the context the scaling extends to: original length x factor (vLLM's rule), never less than declared
    s = dict(config.rope_scaling)
    assert config.max_position_embeddings == max(case["max_position_embeddings"],
                                                 int(s["original_max_position_embeddings"] * s["factor"]))


def test_qwen25_long_context_recipe_extends_the_context():
    """Qwen2.5's README adds YaRN (factor 4 over 32,768) to a config.json that keeps 32,768 positions."""
    case = next(c for c in CASES if c["rope_parameters"].get("original_max_position_embeddings") == 32768)
    assert _config(case).max_position_embeddings == 131072


def test_logits_equal_transformers_hf_gguf_and_checkpoint(tmp_path):
    from magicpig_jax.io.loader import convert_model

    ref = dict(np.load(FIXTURES / "qwen2_yarn_rope_logits.npz"))
    rope = json.loads(str(ref["rope_parameters"]))
    folder = _edited_copy("qwen2", tmp_path, rope_parameters=rope)
    hf = load_model(folder)
    assert dict(hf.config.rope_scaling) == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}
    gguf_path = write_gguf(folder, tmp_path / "yarn.gguf", pre="qwen2")
    gguf_model = load_model(gguf_path)
    assert gguf_model.config.rope_scaling == hf.config.rope_scaling
    assert gguf_model.config.max_position_embeddings == hf.config.max_position_embeddings == 512
    assert read_model_config(gguf_path) == gguf_model.config
    checkpoint = load_model(convert_model(folder, tmp_path / "ckpt"))
    assert checkpoint.config == hf.config
    for model in (hf, gguf_model, checkpoint):
        assert _max_dlogit(model, ref) <= TOLERANCE
    # the scaling matters: the unscaled model, and YaRN without its attention factor, are far off
    assert _max_dlogit(load_model(FIXTURES / "qwen2"), ref) > 0.01
    no_factor = _edited_copy("qwen2", tmp_path / "b", rope_parameters={**rope, "attention_factor": 1.0})
    assert _max_dlogit(load_model(no_factor), ref) > 0.01


def test_greedy_decode_dense_equals_magicpig_under_yarn(tmp_path):
    """The decode path (prefill, cache, host op) uses the same scaled q and k as the forward pass."""
    import magicpig_jax
    from magicpig_jax.generation import encode_prompt, forward_logits

    ref = dict(np.load(FIXTURES / "qwen2_yarn_rope_logits.npz"))
    model = load_model(_edited_copy("qwen2", tmp_path, rope_parameters=json.loads(str(ref["rope_parameters"]))))
    prompt = "The license of this program"
    runs = {att: magicpig_jax.generate(model, prompt, attention=att, max_new_tokens=8, dense_layers=(0,),
                                       chat=False) for att in ("dense", "magicpig")}
    assert runs["magicpig"].token_ids == runs["dense"].token_ids
    ids = encode_prompt(model, prompt, chat=False)
    logits = forward_logits(model, ids + runs["dense"].token_ids[:-1])
    np.testing.assert_array_equal(logits[len(ids) - 1:].argmax(-1), runs["dense"].token_ids)


BASE = {"model_type": "qwen2", "vocab_size": 32, "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024, "rms_norm_eps": 1e-6}


@pytest.mark.parametrize(("rope", "message"), [
    ({"rope_type": "yarn", "original_max_position_embeddings": 512}, "RoPE scaling 'yarn' has no 'factor'"),
    ({"rope_type": "yarn", "factor": 4.0, "extrapolation_factor": 1.0},
     r"RoPE scaling 'yarn': field\(s\) \['extrapolation_factor'\] are not supported"),
    ({"rope_type": "yarn", "factor": -2.0}, "'factor' must be a finite number > 0, got -2.0"),
    ({"rope_type": "yarn", "factor": "4"}, "'factor' must be a finite number > 0, got '4'"),
    ({"rope_type": "yarn", "factor": 4.0, "attention_factor": 0.0}, "'attention_factor' must be a finite number > 0"),
    ({"rope_type": "yarn", "factor": 4.0, "beta_fast": math.inf}, "'beta_fast' must be a finite number >= 0"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 100.5},
     r"'original_max_position_embeddings' must be a positive integer <= 2147483647, got 100.5"),
    ({"rope_type": "yarn", "factor": 4.0, "truncate": "no"}, "'truncate' must be true or false, got 'no'"),
    ({"rope_type": "dynamic", "factor": 4.0}, "unsupported RoPE scaling type 'dynamic'; supported: default, linear, "
                                              "llama3, yarn"),
])
def test_bad_yarn_settings_are_named(rope, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_config({**BASE, "rope_scaling": rope})


def test_gguf_yarn_original_length_defaults_to_the_context(tmp_path):
    """llama.cpp: without rope.scaling.original_context_length YaRN uses the trained context."""
    import gguf

    from magicpig_jax.io.gguf_model import read_gguf_config

    folder = _edited_copy("qwen2", tmp_path, rope_parameters={"rope_type": "yarn", "factor": 2.0,
                                                               "original_max_position_embeddings": 512,
                                                               "rope_theta": 1e6})
    path = write_gguf(folder, tmp_path / "a.gguf", pre="qwen2")
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["qwen2.rope.scaling.original_context_length"].contents() == 512
    config = read_gguf_config(path)
    assert dict(config.rope_scaling)["original_max_position_embeddings"] == 512
    assert config.max_position_embeddings == 1024


def test_a_null_truncate_is_false_as_transformers_reads_it():
    """transformers' ``save_pretrained`` writes ``"truncate": null``; its ``if truncate:`` reads it as false."""
    case = next(c for c in CASES if c["rope_parameters"].get("truncate") is False)
    config = _config({**case, "rope_parameters": {**case["rope_parameters"], "truncate": None}})
    assert dict(config.rope_scaling)["truncate"] is False
    np.testing.assert_allclose(rope_inv_freq(config), case["inv_freq"], rtol=1e-6)


@pytest.mark.parametrize(("changes", "message"), [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 1e308, "original_max_position_embeddings": 1024}},
     r"original_max_position_embeddings \(1024\) x factor \(1e\+308\) must be at most 2147483647"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 10**40}},
     "must be a positive integer <= 2147483647"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": None}},
     "'original_max_position_embeddings' must be a positive integer, got None"),
    ({"max_position_embeddings": 1e20}, "max_position_embeddings must be at most 2147483647"),
    ({"max_position_embeddings": math.inf}, "'max_position_embeddings' must be a positive integer, got inf"),
])
def test_contexts_past_int32_positions_are_refused(changes, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig.from_hf_config({**BASE, **changes})


def test_a_hand_built_yarn_config_needs_its_factor_and_original_length():
    with pytest.raises(ValueError, match="rope_scaling 'yarn' needs 'original_max_position_embeddings'"):
        LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=8, rope_scaling=(("factor", 4.0), ("rope_type", "yarn")))


def _gguf_with(tmp_path, name, **metadata):
    """The unscaled Qwen2 fixture as a GGUF with ``qwen2.rope.*`` metadata added."""
    return write_gguf(FIXTURES / "qwen2", tmp_path / f"{name}.gguf", pre="qwen2",
                      metadata={f"qwen2.rope.{k.replace('__', '.')}": v for k, v in metadata.items()})


def test_gguf_yarn_keys_read_as_llama_cpp_reads_them(tmp_path):
    """The factor under the old ``rope.scale_linear``; the yarn_* keys and attn_factor at llama.cpp's values."""
    from magicpig_jax.io.gguf_model import read_gguf_config

    ref = dict(np.load(FIXTURES / "qwen2_yarn_rope_logits.npz"))
    old_name = _gguf_with(tmp_path, "a", scaling__type="yarn", scale_linear=4.0, scaling__original_context_length=128)
    assert _max_dlogit(load_model(old_name), ref) <= TOLERANCE
    defaults = _gguf_with(tmp_path, "b", scaling__type="yarn", scaling__factor=4.0,
                          scaling__original_context_length=128, scaling__yarn_beta_fast=32.0,
                          scaling__yarn_beta_slow=1.0, scaling__yarn_ext_factor=1.0, scaling__yarn_log_multiplier=0.0,
                          scaling__yarn_attn_factor=1.0 + 0.1 * math.log(4.0), scaling__attn_factor=1.0)
    assert read_gguf_config(defaults) == read_gguf_config(old_name)


@pytest.mark.parametrize(("metadata", "message"), [
    ({"scaling__factor": "4"}, "qwen2.rope.scaling.factor = '4' must be a number"),
    ({"scaling__original_context_length": "32"},
     "qwen2.rope.scaling.original_context_length = '32' must be an integer"),
    ({"scaling__yarn_beta_fast": "fast"}, "qwen2.rope.scaling.yarn_beta_fast = 'fast' must be a number"),
    ({"scaling__original_context_length": 4294967295}, "must be a positive integer <= 2147483647"),
    ({"scaling__yarn_log_multiplier": 0.1}, "yarn_log_multiplier = 0.1.* is not supported"),
    ({"scaling__yarn_attn_factor": 1.5}, r"yarn_attn_factor = 1.5 is not supported .*1 \+ 0.1 ln\(factor\) = 1.13863"),
    ({"scaling__attn_factor": 1.5}, "qwen2.rope.scaling.attn_factor = 1.5 is not implemented"),
])
def test_gguf_yarn_metadata_errors_name_the_key(tmp_path, metadata, message):
    from magicpig_jax.io.gguf_model import read_gguf_config

    path = _gguf_with(tmp_path, "x", **{"scaling__type": "yarn", "scaling__factor": 4.0, **metadata})
    with pytest.raises(ValueError, match=message) as err:
        read_gguf_config(path)
    assert str(path) in str(err.value)


def test_the_rope_names_still_import_from_models_config():
    """They moved to models.rope; models.config re-exports them for existing imports."""
    from magicpig_jax.models import config, rope

    for name in ("rope_inv_freq", "rope_attention_factor", "normalize_rope_scaling", "yarn_context_length"):
        assert getattr(config, name) is getattr(rope, name) and name in config.__all__
