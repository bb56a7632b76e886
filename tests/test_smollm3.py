"""SmolLM3 (``model_type`` smollm3, GGUF ``smollm3``): Llama with every 4th layer's q and k left
without RoPE ("NoPE"), against transformers' logits (``fixtures/families/smollm3*``, written by
``fixtures/make_families.py smollm3``) and transformers' config rules."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from magicpig_jax.generation import forward_logits
from magicpig_jax.io.loader import convert_model, load_model, read_model_config
from magicpig_jax.models.config import LlamaConfig
from tests.test_io_families import FIXTURES, TOLERANCE, gguf_of

BASE = {"model_type": "smollm3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_nope_layers_follow_transformers_config():
    # no list: transformers' default, a NoPE layer every no_rope_layer_interval (4) layers
    assert LlamaConfig.from_hf_config(BASE).nope_layers == (3, 7)
    assert LlamaConfig.from_hf_config({**BASE, "no_rope_layer_interval": 2}).nope_layers == (1, 3, 5, 7)
    # the list: 1 uses RoPE, 0 does not; entries past the layer count are not read (as transformers)
    flags = [1, 0, 1, 1, 0, 1, 1, 1, 0, 0]
    cfg = LlamaConfig.from_hf_config({**BASE, "no_rope_layers": flags})
    assert cfg.nope_layers == (1, 4) and not cfg.layer_uses_rope(4) and cfg.layer_uses_rope(0)
    assert LlamaConfig.from_hf_config({**BASE, "model_type": "llama"}).nope_layers == ()
    for key, value in (("no_rope_layers", [1] * 8), ("no_rope_layer_interval", 4)):  # not read there: refused
        with pytest.raises(ValueError, match=f"'{key}' on a llama model is not supported"):
            LlamaConfig.from_hf_config({**BASE, "model_type": "llama", key: value})
    for bad in ([1] * 7, [1, 2] * 4, "1111", [True] * 8):
        with pytest.raises(ValueError, match="'no_rope_layers' must be a list of at least 8 values 0 or 1"):
            LlamaConfig.from_hf_config({**BASE, "no_rope_layers": bad})
    with pytest.raises(ValueError, match="'no_rope_layer_interval' must be a positive integer"):
        LlamaConfig.from_hf_config({**BASE, "no_rope_layer_interval": 0})
    # a window with no layer_types: transformers windows the NoPE layers
    cfg = LlamaConfig.from_hf_config({**BASE, "use_sliding_window": True, "sliding_window": 16})
    assert (cfg.sliding_window, cfg.windowed_layers) == (16, (3, 7))
    assert LlamaConfig.from_hf_config({**BASE, "sliding_window": 16}).windowed_layers == ()  # not in use
    with pytest.raises(ValueError, match="'sliding_attention' layers while 'use_sliding_window' is false"):
        LlamaConfig.from_hf_config({**BASE, "sliding_window": 16, "layer_types": ["sliding_attention"] * 8})
    assert LlamaConfig.from_hf_config(BASE).tie_word_embeddings  # transformers' SmolLM3 default


def test_nope_layer_matters(tmp_path):
    """The fixture's last layer has no RoPE: the same weights with RoPE there are far off."""
    ref = dict(np.load(FIXTURES / "smollm3_logits.npz"))
    folder = tmp_path / "smollm3_all_rope"
    shutil.copytree(FIXTURES / "smollm3", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["no_rope_layers"] = [1, 1, 1, 1]
    (folder / "config.json").write_text(json.dumps(cfg))
    model = load_model(folder)
    assert model.config.nope_layers == ()
    assert float(np.abs(forward_logits(model, ref["prompt_ids"].tolist()) - ref["logits"]).max()) > 0.01


def test_gguf_and_checkpoint_keep_the_nope_layers(tmp_path):
    """llama.cpp's smollm3 GGUF (q/k rows permuted as for llama, NoPE every 4th layer by the
    architecture) and an orbax checkpoint of it give transformers' logits."""
    ref = dict(np.load(FIXTURES / "smollm3_logits.npz"))
    gguf = gguf_of("smollm3", tmp_path)
    ckpt = convert_model(gguf, tmp_path / "ckpt")
    for path in (gguf, ckpt):
        model = load_model(path)
        assert model.config.nope_layers == (3,) and read_model_config(path) == model.config
        assert float(np.abs(forward_logits(model, ref["prompt_ids"].tolist()) - ref["logits"]).max()) <= TOLERANCE


def test_gguf_window_covers_the_nope_layers(tmp_path):
    """A smollm3 GGUF's ``attention.sliding_window`` windows its NoPE layers, as transformers'
    default layer_types do: the logits of transformers with that window (``smollm3_window``).
    (llama.cpp ignores the key for this architecture.)"""
    from tests.fixtures.gguf_convert import write_gguf

    ref = dict(np.load(FIXTURES / "smollm3_window_logits.npz"))
    path = write_gguf(FIXTURES / "smollm3", tmp_path / "w.gguf", pre="llama-bpe",
                      metadata={"smollm3.attention.sliding_window": 8})
    model = load_model(path)
    assert (model.config.sliding_window, model.config.windowed_layers) == (8, (3,))
    assert float(np.abs(forward_logits(model, ref["prompt_ids"].tolist()) - ref["logits"]).max()) <= TOLERANCE


def test_a_config_without_rope_theta_takes_smollm3s_own_base():
    """transformers' SmolLM3Config defaults rope_theta to 2e6; a config.json without it ran at 10000
    (the other types' default) without a word: logits 16% of the largest off."""
    base = {k: v for k, v in BASE.items() if k not in ("rope_theta", "rope_parameters")}
    assert LlamaConfig.from_hf_config(base).rope_theta == 2_000_000.0
    assert LlamaConfig.from_hf_config({**base, "rope_theta": 5e5}).rope_theta == 5e5
    assert LlamaConfig.from_hf_config({**base, "model_type": "llama"}).rope_theta == 10000.0
