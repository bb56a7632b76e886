"""Phi-3 (``model_type`` phi3, GGUF ``phi3``): Llama with q/k/v fused in ``qkv_proj`` and gate/up in
``gate_up_proj``, and LongRoPE (Phi-3 128K, Phi-3.5), against transformers' logits
(``fixtures/families/phi3*``, written by ``fixtures/make_families.py phi3``) and transformers' config
rules. The family's HF, GGUF and greedy-decoding checks are those of every family
(``test_io_families.py``), its window's those of ``test_sliding_window.py``."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from magicpig_jax.generation import forward_logits
from magicpig_jax.io.loader import convert_model, load_model, read_model_config
from magicpig_jax.models.config import LlamaConfig, UnsupportedConfigError
from magicpig_jax.models.rope import rope_attention_factor
from tests.fixtures.gguf_convert import write_gguf
from tests.test_io_families import FIXTURES, TOLERANCE, _spm_vocab

BASE = {"model_type": "phi3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


def test_config_follows_transformers():
    cfg = LlamaConfig.from_hf_config({**BASE, "original_max_position_embeddings": 4096, "resid_pdrop": 0.1})
    assert (cfg.head_dim, cfg.max_position_embeddings, cfg.rms_norm_eps) == (8, 4096, 1e-5)  # Phi3Config defaults
    assert cfg.sliding_window is None and not cfg.tie_word_embeddings
    assert LlamaConfig.from_hf_config({k: v for k, v in BASE.items() if k != "num_key_value_heads"}).num_kv_heads == 4
    # Phi-3-mini-4k's window: every layer, as Mistral's
    assert LlamaConfig.from_hf_config({**BASE, "sliding_window": 2047}).windowed_layers == (0, 1)
    with pytest.raises(UnsupportedConfigError, match="'layer_types' with 'full_attention' layers on a phi3 model"):
        LlamaConfig.from_hf_config({**BASE, "sliding_window": 16,
                                    "layer_types": ["full_attention", "sliding_attention"]})
    # LongRoPE, under each name transformers reads as it ("yarn" too, which is not YaRN here); the
    # pretrained context is the top-level field (Phi3Config's default 4096), not the scaling's
    for key in ("rope_scaling", "rope_parameters"):
        for kind in ("longrope", "su", "yarn"):
            scaling = {"type" if kind == "su" else "rope_type": kind, "short_factor": [1, 1.5, 2, 3],
                       "long_factor": [2.0] * 4, "original_max_position_embeddings": 99}
            cfg = LlamaConfig.from_hf_config({**BASE, key: scaling, "max_position_embeddings": 131072})
            assert cfg.longrope_switch == 4096 and dict(cfg.rope_scaling)["short_factor"] == (1.0, 1.5, 2.0, 3.0)
        with pytest.raises(UnsupportedConfigError, match="type 'linear' of a phi3 model is not supported"):
            LlamaConfig.from_hf_config({**BASE, key: {"rope_type": "linear", "factor": 2.0}})
    longrope = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    assert LlamaConfig.from_hf_config({**BASE, "rope_scaling": longrope, "original_max_position_embeddings": 512,
                                       "max_position_embeddings": 8192}).longrope_switch == 512
    assert rope_attention_factor(LlamaConfig.from_hf_config(
        {**BASE, "rope_scaling": longrope, "original_max_position_embeddings": 512,
         "max_position_embeddings": 8192})) == pytest.approx(np.sqrt(1 + np.log(16) / np.log(512)))
    with pytest.raises(ValueError, match="'short_factor' needs the rotated dims / 2 = 4 values, got 3"):
        LlamaConfig.from_hf_config({**BASE, "rope_scaling": {**longrope, "short_factor": [1.0] * 3}})
    with pytest.raises(ValueError, match="'long_factor' must be a list of finite numbers > 0"):
        LlamaConfig.from_hf_config({**BASE, "rope_scaling": {**longrope, "long_factor": [1.0, 0.0, 1.0, 1.0]}})
    # Phi-4-mini's partial RoPE: the rope dict's fraction, else the top level's (transformers' Phi3Config)
    assert LlamaConfig.from_hf_config({**BASE, "partial_rotary_factor": 0.5}).rotary_dim == 4
    assert LlamaConfig.from_hf_config({**BASE, "partial_rotary_factor": 0.5, "rope_parameters": {
        "rope_type": "default", "partial_rotary_factor": 1.0}}).rope_dim is None
    with pytest.raises(UnsupportedConfigError, match="rotates 3 of the 8 dimensions"):
        LlamaConfig.from_hf_config({**BASE, "partial_rotary_factor": 0.375})
    with pytest.raises(UnsupportedConfigError, match="partial RoPE is not implemented"):
        LlamaConfig.from_hf_config({**BASE, "model_type": "llama", "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="'original_max_position_embeddings' must be a positive integer"):
        LlamaConfig.from_hf_config({**BASE, "original_max_position_embeddings": 0})
    # read for phi3 only: elsewhere an unknown field, refused as before
    for key, value in (("original_max_position_embeddings", 4096), ("full_attn_mod", 1)):
        with pytest.raises(UnsupportedConfigError, match=f"field\\(s\\) '{key}' of this llama model are not"):
            LlamaConfig.from_hf_config({**BASE, "model_type": "llama", key: value})
    # Phi-4-mini's and Phi-3's published fields for their remote code: accepted at the values
    # transformers' own Phi3 computes, refused otherwise
    neutral = {"auto_map": {"AutoModelForCausalLM": "modeling_phi3.Phi3ForCausalLM"}, "full_attn_mod": 1,
               "interpolate_factor": 1, "lm_head_bias": False}
    assert LlamaConfig.from_hf_config({**BASE, **neutral}) == LlamaConfig.from_hf_config(BASE)
    for key, value in (("full_attn_mod", 2), ("interpolate_factor", 4), ("lm_head_bias", True)):
        with pytest.raises(UnsupportedConfigError, match=f"'{key}' = {value!r} is not supported"):
            LlamaConfig.from_hf_config({**BASE, key: value})


def test_fused_matrices_of_the_wrong_size_are_refused(tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "phi3"
    shutil.copytree(FIXTURES / "phi3", folder)
    weights = load_file(str(folder / "model.safetensors"))
    weights["model.layers.1.mlp.gate_up_proj.weight"] = weights["model.layers.1.mlp.gate_up_proj.weight"][:-1]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"'model.layers.1.mlp.gate_up_proj.weight' has shape \(191, 64\); "
                                         r"96 \+ 96 = 192 rows \(gate_proj, up_proj\) expected"):
        load_model(folder)
    # Llama's unfused names in a phi3 checkpoint: transformers' Phi3 would leave its fused matrices random
    gate_up = weights.pop("model.layers.1.mlp.gate_up_proj.weight")
    weights["model.layers.1.mlp.gate_proj.weight"] = gate_up[:95]
    weights["model.layers.1.mlp.up_proj.weight"] = gate_up[95:]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(UnsupportedConfigError, match="'model.layers.1.mlp.gate_proj.weight': a phi3 checkpoint holds"):
        load_model(folder)


def test_quantized_gguf_splits_the_fused_rows(tmp_path):
    """Q8_0 fused matrices (``attn_qkv``, ``ffn_up``) split by rows into packed q/k/v and gate/up:
    the same logits as their float32 dequantization, and near transformers'; an orbax checkpoint
    of it keeps them."""
    ref = dict(np.load(FIXTURES / "phi3_logits.npz"))
    path = write_gguf(FIXTURES / "phi3", tmp_path / "q8.gguf", spm_vocab=_spm_vocab(), qtype="Q8_0")
    packed = load_model(path)
    attn = packed.module.layers[0].self_attn
    assert attn.qkv_qtype == "Q8_0" and packed.module.layers[0].mlp.gate_up_qtype == "Q8_0"
    ids = ref["prompt_ids"].tolist()
    got = forward_logits(packed, ids)
    assert float(np.abs(got - forward_logits(load_model(path, packed_weights=False), ids)).max()) <= TOLERANCE
    assert 1e-4 < float(np.abs(got - ref["logits"]).mean()) < 0.05  # Q8_0's rounding, nothing more
    ckpt = convert_model(path, tmp_path / "ckpt")
    assert read_model_config(ckpt) == packed.config
    assert float(np.abs(forward_logits(load_model(ckpt), ids) - got).max()) <= TOLERANCE


def test_gguf_longrope_and_bad_fused_tensors_are_refused(tmp_path):
    import gguf

    base = write_gguf(FIXTURES / "phi3", tmp_path / "p.gguf", spm_vocab=_spm_vocab())
    reader = gguf.GGUFReader(str(base))

    def rewrite(out, extra_tensor=None, drop=None, shrink=None):
        w = gguf.GGUFWriter(str(out), "phi3")
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue
            value = field.contents()
            if field.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_array(name, value)
            else:
                w.add_key_value(name, value, field.types[0])
        for t in reader.tensors:
            if t.name == drop:
                continue
            data = np.asarray(t.data)
            if t.name == shrink:
                data = data[:-16]
            w.add_tensor(t.name, data, raw_dtype=t.tensor_type)
        if extra_tensor:
            w.add_tensor(extra_tensor, np.ones(4, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return out

    with pytest.raises(UnsupportedConfigError, match="rope_factors_long.weight are supported as the pair"):
        load_model(rewrite(tmp_path / "long.gguf", extra_tensor="rope_factors_long.weight"))
    with pytest.raises(UnsupportedConfigError, match=r"tensor blk.0.attn_qkv.weight has shape \(112, 64\); "
                                                     r"128 rows \(64 \+ 32 \+ 32\) of 64 expected"):
        load_model(rewrite(tmp_path / "short.gguf", shrink="blk.0.attn_qkv.weight"))
    with pytest.raises(ValueError, match="lacks tensor.* blk.1.ffn_up.weight"):
        load_model(rewrite(tmp_path / "missing.gguf", drop="blk.1.ffn_up.weight"))


def test_window_is_applied_as_transformers_does(tmp_path):
    """Phi-3-mini-4k's config sets a window (2047): transformers windows every layer, and so does a
    GGUF's ``phi3.attention.sliding_window`` here (llama.cpp 0.3.36 ignores that key: measured, its
    logits equal the window-free ones)."""
    ref = dict(np.load(FIXTURES / "phi3_window_logits.npz"))
    folder = tmp_path / "w"
    shutil.copytree(FIXTURES / "phi3", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["sliding_window"] = 8
    (folder / "config.json").write_text(json.dumps(cfg))
    path = write_gguf(folder, tmp_path / "w.gguf", spm_vocab=_spm_vocab())
    model = load_model(path)
    assert model.config.windowed_layers == (0, 1)
    assert float(np.abs(forward_logits(model, ref["prompt_ids"].tolist()) - ref["logits"]).max()) <= TOLERANCE


def test_gguf_chat_tokens_swallow_the_whitespace_after_them(tmp_path):
    """llama.cpp gives a Phi-3 model's control and user-defined tokens RSTRIP, by its ``general.name``
    (as Phi-3's tokenizer.json marks them; the GGUF has no field for it): ``<|end|>\\n`` is one token.
    Expected ids: llama.cpp's (llama-cpp-python 0.3.36, ``tokenize(special=True)``) on these files."""
    from tests.fixtures.gguf_convert import tokenizer_metadata

    meta = tokenizer_metadata(FIXTURES / "phi3", None, 608, _spm_vocab())
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    for k, (text, kind) in enumerate([("<|endoftext|>", 3), ("<|assistant|>", 4), ("<|user|>", 4), ("<|end|>", 4),
                                      ("<|system|>", 4)]):
        tokens[607 - k], types[607 - k] = text, kind
    chat = "<|user|>\nHello<|end|>\n<|assistant|>\n"
    for name, ids in (("Phi-3-mini-4k-instruct", {chat: [605, 414, 482, 415, 359, 416, 604, 606],
                                                  "</s>  a": [2, 261], "<|endoftext|> a": [607, 259, 418]}),
                      ("Other model", {chat: [605, 414, 13, 482, 415, 359, 416, 604, 414, 13, 606, 414, 13]})):
        path = write_gguf(FIXTURES / "phi3", tmp_path / f"{name}.gguf", spm_vocab=_spm_vocab(),
                          metadata={"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
                                    "general.name": name})
        tok = load_model(path).tokenizer
        for text, want in ids.items():
            assert tok.encode(text, parse_special=True, add_special_tokens=False) == want, (name, text)


def _longrope_dir(tmp_path, ref):
    folder = tmp_path / "longrope"
    shutil.copytree(FIXTURES / "phi3", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(json.loads(str(ref["config_changes"])))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("host", [True, False])
def test_longrope_follows_transformers(tmp_path, host):
    """LongRoPE's factors as transformers applies them (``phi3_longrope``: pretrained context 16):
    a 36-token prompt rotated with the long factors, a 12-token one with the short ones, and greedy
    decoding from the 12 tokens through the cache, each step by its own position (the short
    factors until position 15, the long ones after; the prompt's keys keep the short ones)."""
    import dataclasses

    from magicpig_jax.eval.forcing import forced_decode
    from magicpig_jax.generation import decode_spec, prefill

    ref = dict(np.load(FIXTURES / "phi3_longrope_logits.npz"))
    model = load_model(_longrope_dir(tmp_path, ref))
    ids, generated = ref["prompt_ids"].tolist(), ref["generated"].tolist()
    assert model.config.longrope_switch == 16 and rope_attention_factor(model.config) == pytest.approx(1.5)
    if host:  # the forward pass is the same for both
        assert float(np.abs(forward_logits(model, ids) - ref["logits"]).max()) <= TOLERANCE
        assert float(np.abs(forward_logits(model, ids[:12]) - ref["short_logits"]).max()) <= TOLERANCE
    state = prefill(model, [ids[:12]], len(generated))
    spec = dataclasses.replace(decode_spec(model, "dense", positions=state.cache.capacity), host=host)
    steps = {}
    forced_decode(model, state, forced_tokens=[generated], max_new_tokens=len(generated), spec=spec,
                  stop_on_eos=False, logits_callback=lambda t, x: steps.setdefault(t, x[0].copy()))
    got = np.stack([steps[t] for t in range(len(generated))])
    assert float(np.abs(got - ref["step_logits"]).max()) <= TOLERANCE
    # one forward pass over the same 32 tokens rotates them all with the long factors: far off
    whole = forward_logits(model, ids[:12] + generated[:-1])[11:]
    assert float(np.abs(whole - ref["step_logits"]).max()) > 0.01


def test_longrope_gguf_and_checkpoint(tmp_path):
    """llama.cpp's converter writes the factors as ``rope_factors_short/long`` tensors with
    ``rope.scaling.attn_factor`` and ``original_context_length`` (llama.cpp 0.3.36 on such a file,
    its context past 16: within 3e-5 of transformers' long-factor logits); read back as the same
    LongRoPE, and kept by an orbax checkpoint."""
    ref = dict(np.load(FIXTURES / "phi3_longrope_logits.npz"))
    folder = _longrope_dir(tmp_path, ref)
    path = write_gguf(folder, tmp_path / "lr.gguf", spm_vocab=_spm_vocab())
    ckpt = convert_model(path, tmp_path / "ckpt")
    ids = ref["prompt_ids"].tolist()
    for p in (path, ckpt):
        model = load_model(p)
        assert model.config.longrope_switch == 16 and read_model_config(p) == model.config
        assert float(np.abs(forward_logits(model, ids) - ref["logits"]).max()) <= TOLERANCE
        assert float(np.abs(forward_logits(model, ids[:12]) - ref["short_logits"]).max()) <= TOLERANCE


def test_partial_rope_follows_transformers(tmp_path):
    """Phi-4-mini's layout: RoPE on the leading half of each head (``partial_rotary_factor`` 0.5), with
    LongRoPE factors for those frequencies (``phi3_partial``); HF, GGUF (``rope.dimension_count`` 8 of
    16, as llama.cpp's converter writes it) and orbax."""
    ref = dict(np.load(FIXTURES / "phi3_partial_logits.npz"))
    folder = _longrope_dir(tmp_path, ref)
    ids = ref["prompt_ids"].tolist()
    gguf = write_gguf(folder, tmp_path / "p.gguf", spm_vocab=_spm_vocab())
    for path in (folder, gguf, convert_model(gguf, tmp_path / "ckpt")):
        model = load_model(path)
        assert (model.config.rope_dim, model.config.longrope_switch) == (8, 16)
        assert float(np.abs(forward_logits(model, ids) - ref["logits"]).max()) <= TOLERANCE, path
        assert float(np.abs(forward_logits(model, ids[:12]) - ref["short_logits"]).max()) <= TOLERANCE, path


def test_longrope_prefix_states_and_bad_values(tmp_path):
    """Review findings: a prefix within the pretrained context of a prompt past it is rotated with the
    short factors (its own prefill; the shared one would carry the prompt's long factors); a GGUF
    without ``rope.scaling.attn_factor`` scales by 1, as llama.cpp reads it; out-of-range contexts and
    factors whose frequencies overflow float32 are refused at load."""
    from magicpig_jax.generation import prefill_with_prefixes

    ref = dict(np.load(FIXTURES / "phi3_longrope_logits.npz"))
    folder = _longrope_dir(tmp_path, ref)
    model = load_model(folder)
    ids = ref["prompt_ids"].tolist()
    full, part = prefill_with_prefixes(model, [ids], [12], 4)
    assert float(np.abs(np.asarray(full.last_logits[0]) - ref["logits"][-1]).max()) <= TOLERANCE
    assert float(np.abs(np.asarray(part.last_logits[0]) - ref["short_logits"][-1]).max()) <= TOLERANCE
    assert part.cache.capacity >= 36 + 4 and list(part.prompt_lengths) == [12]
    # a NumPy-integer max_new_tokens sizes the prefix's cache as the int does (np.uint8(250) wrapped)
    for n in (np.uint8(250), np.int32(2**31 - 1)):
        got = prefill_with_prefixes(model, [ids[:20]], [10], n)
        want = prefill_with_prefixes(model, [ids[:20]], [10], int(n))
        assert [s.cache.capacity for s in got] == [s.cache.capacity for s in want]
    path = write_gguf(folder, tmp_path / "lr.gguf", spm_vocab=_spm_vocab(),
                      metadata={"phi3.rope.scaling.attn_factor": None})
    assert rope_attention_factor(load_model(path).config) == 1.0
    path = write_gguf(folder, tmp_path / "lin.gguf", spm_vocab=_spm_vocab(), metadata={"phi3.rope.scaling.factor": 2.0})
    with pytest.raises(ValueError, match="phi3.rope.scaling.factor = 2.0 together with LongRoPE's factors"):
        load_model(path)
    cfg = json.loads((folder / "config.json").read_text())
    for changes, message in (({"original_max_position_embeddings": 2**31}, "at most 2147483647"),
                             ({"original_max_position_embeddings": None}, "must be a positive integer"),
                             ({"rope_parameters": {**cfg["rope_parameters"], "short_factor": [1e-300] * 8}},
                              "short_factor gives frequencies that overflow float32")):
        with pytest.raises(ValueError, match=message):
            LlamaConfig.from_hf_config({**cfg, **changes})
