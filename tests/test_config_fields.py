"""config.json fields that real checkpoints carry, and contradictions between fields that give one
value twice: accepted where transformers' computation does not depend on them, refused (named)
where they disagree or cannot be read as transformers reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from magicpig_jax.models.config import LlamaConfig, UnsupportedConfigError

FAMILIES = Path(__file__).parent / "fixtures" / "families"


def _config(family: str, **changes) -> dict:
    cfg = json.loads((FAMILIES / family / "config.json").read_text(encoding="utf-8"))
    cfg.update(changes)
    return {k: v for k, v in cfg.items() if v is not _DROP}


_DROP = object()


def test_smollm2_export_fields_are_accepted():
    """HuggingFaceTB/SmolLM2-*'s config.json has nanotron's and transformers.js's fields, which
    transformers' LlamaConfig ignores."""
    base = LlamaConfig.from_hf_config(_config("llama3"))
    extra = {"is_llama_config": True, "rope_interleaved": False,
             "transformers.js_config": {"kv_cache_dtype": {"q4f16": "float16", "fp16": "float16"}}}
    assert LlamaConfig.from_hf_config(_config("llama3", **extra)) == base
    with pytest.raises(UnsupportedConfigError, match="'rope_interleaved' = True is not supported"):
        LlamaConfig.from_hf_config(_config("llama3", rope_interleaved=True))


def test_qwen2_window_fields_are_typed():
    on = dict(use_sliding_window=True, sliding_window=4096, layer_types=_DROP)  # the layers from max_window_layers
    assert LlamaConfig.from_hf_config(_config("qwen2", **on, max_window_layers=1)).sliding_layers == (1,)
    for bad in (1.5, "1", True):
        with pytest.raises(ValueError, match=f"'max_window_layers' must be an integer, got {bad!r}"):
            LlamaConfig.from_hf_config(_config("qwen2", **on, max_window_layers=bad))
    with pytest.raises(ValueError, match="'use_sliding_window' must be true or false, got 'false'"):
        LlamaConfig.from_hf_config(_config("qwen2", use_sliding_window="false", sliding_window=4096))
    assert LlamaConfig.from_hf_config(_config("qwen2", use_sliding_window=None)).sliding_window is None


def test_gemma3_rope_given_twice_must_agree():
    base = LlamaConfig.from_hf_config(_config("gemma3"))
    # the same values twice: accepted, the same config
    same = _config("gemma3", rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                   rope_scaling={"type": "linear", "factor": 8.0})
    assert LlamaConfig.from_hf_config(same) == base
    with pytest.raises(ValueError, match=r"different RoPE bases: rope_theta = 500000.0, rope_parameters.full_attention"
                                         r".rope_theta = 1000000.0; keep one"):
        LlamaConfig.from_hf_config(_config("gemma3", rope_theta=500_000.0))
    with pytest.raises(ValueError, match=r"different RoPE bases: rope_local_base_freq = 20000.0, rope_parameters."
                                         r"sliding_attention.rope_theta = 10000.0; keep one"):
        LlamaConfig.from_hf_config(_config("gemma3", rope_local_base_freq=20_000.0))
    with pytest.raises(UnsupportedConfigError, match="'rope_scaling' .* and 'rope_parameters.full_attention' .* "
                                                     "describe different RoPE scalings; keep one"):
        LlamaConfig.from_hf_config(_config("gemma3", rope_scaling={"rope_type": "linear", "factor": 4.0}))
    # only the flat fields (transformers 4's layout): they give the values
    flat = _config("gemma3", rope_parameters=_DROP, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                   rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert LlamaConfig.from_hf_config(flat) == base
