"""Gemma 3 text models (``model_type`` gemma3_text: Gemma-3-1B, and the language model of the larger
ones saved as text-only) against transformers' logits (``fixtures/families/gemma3*``, written by
``fixtures/make_families.py gemma3``) and transformers' config rules.

The fixture has what sets Gemma 3 apart from Llama: norms stored as ``w`` for ``1 + w``, sandwich
norms, GeGLU (tanh GELU), embeddings times ``sqrt(hidden)``, q/k norms, a query scale from
``query_pre_attn_scalar`` (24, not the head dim 16), sliding-window layers (0 and 2, window 8) with
their own RoPE base, and a full-attention layer (1) with the global base and linear scaling. Its
decoding is in ``test_gemma_decode.py``, its offload-decoder run in ``test_offload.py``.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from magicpig_jax.generation import forward_logits
from magicpig_jax.io.loader import load_model, read_model_config
from magicpig_jax.models.config import LlamaConfig, UnsupportedConfigError
from tests.test_io_families import FIXTURES, TOLERANCE

FOLDER = FIXTURES / "gemma3"

# google/gemma-3-1b-it's config.json as published (transformers 4.50 format)
GEMMA3_1B = {
    "architectures": ["Gemma3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": None, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 106],
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "initializer_range": 0.02, "intermediate_size": 6912, "max_position_embeddings": 32768,
    "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
    "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0", "use_cache": True, "vocab_size": 262144,
}


def _ref(name: str = "gemma3") -> dict:
    return dict(np.load(FIXTURES / f"{name}_logits.npz"))


def _with_config(tmp_path, **changes):
    folder = tmp_path / "gemma3"
    shutil.copytree(FOLDER, folder, dirs_exist_ok=True)
    cfg = json.loads((FOLDER / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_config_follows_transformers():
    cfg = LlamaConfig.from_hf_config(GEMMA3_1B)
    # every 6th layer full (5, 11, ...), the rest slide over 512 positions with the local base
    assert cfg.windowed_layers == tuple(i for i in range(26) if (i + 1) % 6) and cfg.sliding_window == 512
    assert (cfg.rope_theta, cfg.local_rope_theta, cfg.rope_scaling) == (1e6, 1e4, None)
    assert cfg.query_scale == 256 ** -0.5 and cfg.embedding_scale == math.sqrt(1152)
    assert cfg.qk_norm and cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh" and cfg.tie_word_embeddings
    assert cfg.eos_token_ids == (1, 106) and (cfg.head_dim, cfg.num_kv_heads) == (256, 1)
    assert cfg.layer_uses_local_rope(0) and not cfg.layer_uses_local_rope(5)
    # Gemma-3-4B's language model: linear scaling on the full-attention layers only (legacy form)
    four_b = LlamaConfig.from_hf_config({**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert dict(four_b.rope_scaling) == {"rope_type": "linear", "factor": 8.0} and four_b.local_rope_theta == 1e4
    # transformers 5's form: a base per layer type
    nested = {k: v for k, v in GEMMA3_1B.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling")}
    nested["rope_parameters"] = {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}
    cfg = LlamaConfig.from_hf_config(nested)
    assert (cfg.rope_theta, cfg.local_rope_theta) == (5e5, 2e4)
    assert LlamaConfig.from_hf_config({**GEMMA3_1B, "query_pre_attn_scalar": 168}).query_scale == 168 ** -0.5
    # no eos_token_id: Gemma3TextConfig's default, 1 (<eos>)
    assert LlamaConfig.from_hf_config({k: v for k, v in GEMMA3_1B.items() if k != "eos_token_id"}).eos_token_ids == (1,)
    layer_types = ["full_attention"] * 25 + ["sliding_attention"]
    assert LlamaConfig.from_hf_config({**GEMMA3_1B, "layer_types": layer_types}).windowed_layers == (25,)


@pytest.mark.parametrize("changes, match", [
    ({"final_logit_softcapping": 30.0}, "'final_logit_softcapping' = 30.0 is not supported on a gemma3_text model"),
    ({"attn_logit_softcapping": 50.0}, "'attn_logit_softcapping' = 50.0"),
    ({"use_bidirectional_attention": True}, "'use_bidirectional_attention' = true is not supported"),
    ({"hidden_activation": "gelu"}, "'hidden_activation' = 'gelu' is not supported"),
    ({"hidden_act": "gelu_pytorch_tanh"}, "'hidden_act' on a gemma3_text model is not supported"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn' of the full-attention layers"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 8.0}}, "must map 'full_attention' and 'sliding_attention'"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "RoPE of the sliding-window layers"),
    ({"sliding_window": None}, "'sliding_window' is null while 'layer_types' has 'sliding_attention' layers"),
    ({"query_pre_attn_scalar": 0}, "'query_pre_attn_scalar' must be a finite number > 0"),
    ({"model_type": "gemma3"}, "unsupported model_type 'gemma3'"),
])
def test_what_is_not_implemented_is_refused(changes, match):
    with pytest.raises(ValueError, match=match) as info:
        LlamaConfig.from_hf_config({**GEMMA3_1B, **changes})
    # a field or value we do not implement is UnsupportedConfigError; a malformed one a plain ValueError
    assert isinstance(info.value, UnsupportedConfigError) == ("must" not in match)


def test_logits_match_transformers(tmp_path):
    ref = _ref()
    model = load_model(FOLDER)
    assert model.config.windowed_layers == (0, 2) and model.config.query_scale == 24 ** -0.5
    assert float(np.abs(forward_logits(model, ref["prompt_ids"].tolist()) - ref["logits"]).max()) <= TOLERANCE
    # each of the query scale, the local base and the global scaling changes the logits: the
    # fixture exercises them (a model without them is far off)
    for changes in ({"query_pre_attn_scalar": 16},
                    {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}},
                    {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}):
        other = load_model(_with_config(tmp_path, **changes))
        assert float(np.abs(forward_logits(other, ref["prompt_ids"].tolist()) - ref["logits"]).max()) > 0.01, changes


# --- GGUF (llama.cpp's gemma3) ----------------------------------------------------------------


def _gguf(folder, out, **kw):
    from tests.fixtures.gguf_convert import write_gguf
    from tests.test_io_families import _spm_vocab

    return write_gguf(folder, out, spm_vocab=_spm_vocab(), **kw)


def test_gguf_matches_transformers(tmp_path):
    """The 6-layer fixture in transformers' default pattern (what llama.cpp's gemma3 holds: every 6th
    layer full, the query scale 1/sqrt(head_dim)) as a GGUF written under llama.cpp's converter
    conventions (norms stored as 1 + w), F16 and Q8_0 matrices; and the same layers as the HF dir."""
    ref = _ref("gemma3_default")
    hf = load_model(FIXTURES / "gemma3_default")
    gguf_model = load_model(_gguf(FIXTURES / "gemma3_default", tmp_path / "g.gguf"))
    for key in ("windowed_layers", "sliding_window", "local_rope_theta", "rope_theta", "rope_scaling", "query_scale",
                "embedding_scale", "hidden_act", "sandwich_norms", "qk_norm", "tie_word_embeddings"):
        assert getattr(gguf_model.config, key) == getattr(hf.config, key), key
    assert gguf_model.config.windowed_layers == (0, 1, 2, 3, 4)
    for model in (hf, gguf_model):
        assert float(np.abs(forward_logits(model, ref["prompt_ids"].tolist()) - ref["logits"]).max()) <= TOLERANCE
    # Q8_0 rows held as they are: their float32 dequantization's logits, near transformers'
    path = _gguf(FIXTURES / "gemma3_default", tmp_path / "q8.gguf", qtype="Q8_0")
    ids = ref["prompt_ids"].tolist()
    q8 = forward_logits(load_model(path), ids)
    assert float(np.abs(q8 - forward_logits(load_model(path, packed_weights=False), ids)).max()) <= TOLERANCE
    # Q8_0 rounding only: small beside the logits (their std is about 13)
    assert 1e-4 < float(np.abs(q8 - ref["logits"]).mean()) < 0.02 * float(ref["logits"].std())


def _random_gemma3_dir(folder, layers: int, H: int = 16, heads: int = 2):
    """A tiny random gemma3_text HF directory of ``layers`` layers (hidden ``H``, ``heads`` heads of 4,
    1 KV head), its query_pre_attn_scalar ``H // heads`` (Gemma-3-27B's rule) and the fixture's tokenizer."""
    from safetensors.numpy import save_file

    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FOLDER / name, folder / name)
    F, V, D = 24, 608, 4
    cfg = {"model_type": "gemma3_text", "vocab_size": V, "hidden_size": H, "intermediate_size": F,
           "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 1, "head_dim": D,
           "query_pre_attn_scalar": H // heads, "sliding_window": 8, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 512, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(layers)
    shapes = {"self_attn.q_proj.weight": (heads * D, H), "self_attn.k_proj.weight": (D, H),
              "self_attn.v_proj.weight": (D, H), "self_attn.o_proj.weight": (H, heads * D),
              "mlp.gate_proj.weight": (F, H), "mlp.up_proj.weight": (F, H), "mlp.down_proj.weight": (H, F),
              "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
              "pre_feedforward_layernorm.weight": (H,), "post_feedforward_layernorm.weight": (H,),
              "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,)}
    # float16 values (a GGUF stores the matrices as F16), held as float32
    weights = {f"model.layers.{i}.{k}": (0.3 * rng.standard_normal(s)).astype(np.float16).astype(np.float32)
               for i in range(layers) for k, s in shapes.items()}
    weights["model.embed_tokens.weight"] = (0.5 * rng.standard_normal((V, H))).astype(np.float16).astype(np.float32)
    weights["model.norm.weight"] = (0.1 * rng.standard_normal(H)).astype(np.float32)
    save_file(weights, str(folder / "model.safetensors"))
    return folder


def test_gguf_query_scale_follows_llama_cpp(tmp_path):
    """llama.cpp's gemma3 scales q . k by 1/sqrt(hidden / heads) at 62 layers (Gemma-3-27B, whose
    query_pre_attn_scalar is hidden / heads), else by 1/sqrt(head_dim): at 62 layers the GGUF gives
    the HF directory's logits; at 61 the GGUF's scale is the head dim's."""

    big = _random_gemma3_dir(tmp_path / "l62", 62)
    gguf_config = read_model_config(_gguf(big, tmp_path / "l62.gguf"))
    assert gguf_config.query_scale == pytest.approx(8 ** -0.5) and gguf_config.windowed_layers == tuple(
        i for i in range(62) if (i + 1) % 6)
    ids = list(range(3, 40))
    hf = forward_logits(load_model(big), ids)
    diff = np.abs(hf - forward_logits(load_model(tmp_path / "l62.gguf"), ids))
    # 62 layers add up float32 rounding beyond the fixtures' TOLERANCE (9e-5 with jax 0.12.0, 1.2e-4
    # with 0.12.1, logits up to 8.2); the head dim's scale, 1/sqrt(4) for 1/sqrt(8), is far off
    assert float(diff.max()) <= 5e-4
    small = _random_gemma3_dir(tmp_path / "l61", 61)
    assert read_model_config(_gguf(small, tmp_path / "l61.gguf")).query_scale == 4 ** -0.5  # 1/sqrt(head_dim)
    # hidden / heads is llama.cpp's integer division (20 // 3 = 6)
    odd = _random_gemma3_dir(tmp_path / "l62odd", 62, H=20, heads=3)
    assert read_model_config(_gguf(odd, tmp_path / "l62odd.gguf")).query_scale == 6 ** -0.5


def test_gguf_sliding_layers_base_is_read(tmp_path):
    """``gemma3.rope.freq_base_swa`` (llama.cpp's converter writes the sliding layers' base there; 10000
    without it): a checkpoint with another local base gives the same logits as its HF directory, and
    other logits than with 10000."""
    cfg = json.loads((FIXTURES / "gemma3_default" / "config.json").read_text())
    cfg["rope_parameters"]["sliding_attention"]["rope_theta"] = 50000.0
    folder = tmp_path / "base5e4"
    shutil.copytree(FIXTURES / "gemma3_default", folder)
    (folder / "config.json").write_text(json.dumps(cfg))
    ids = _ref("gemma3_default")["prompt_ids"].tolist()
    path = _gguf(folder, tmp_path / "base5e4.gguf")
    model = load_model(path)
    assert model.config.local_rope_theta == 50000.0
    hf = forward_logits(load_model(folder), ids)
    assert float(np.abs(forward_logits(model, ids) - hf).max()) <= TOLERANCE
    without = load_model(_gguf(folder, tmp_path / "nobase.gguf", metadata={"gemma3.rope.freq_base_swa": None}))
    assert without.config.local_rope_theta == 10000.0
    assert float(np.abs(forward_logits(without, ids) - hf).max()) > 0.01


def test_gguf_without_what_gemma3_needs_is_refused(tmp_path):
    from magicpig_jax.io.gguf_model import GGUFMetadataError

    with pytest.raises(GGUFMetadataError, match="a gemma3 model needs gemma3.attention.sliding_window > 0"):
        load_model(_gguf(FIXTURES / "gemma3_default", tmp_path / "nw.gguf",
                         metadata={"gemma3.attention.sliding_window": 0}))
    with pytest.raises(UnsupportedConfigError, match="only one integer window for the model is supported"):
        load_model(_gguf(FIXTURES / "gemma3_default", tmp_path / "arr.gguf",
                         metadata={"gemma3.attention.sliding_window": [8] * 6}))
    with pytest.raises(UnsupportedConfigError, match="rope.scaling.type 'yarn' is not supported for gemma3"):
        load_model(_gguf(FIXTURES / "gemma3_default", tmp_path / "yarn.gguf",
                         metadata={"gemma3.rope.scaling.type": "yarn", "gemma3.rope.scaling.factor": 4.0,
                                   "gemma3.rope.scaling.original_context_length": 128}))
