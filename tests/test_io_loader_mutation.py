"""The GGUF reader (``magicpig_jax.io.gguf_model``) and the loader (``magicpig_jax.io.loader``)
against independent references (issue 18, mutation testing).

Every GGUF here is written by hand with gguf-py's ``GGUFWriter``: llama.cpp's q/k row
permutation is applied by this file's own ``_permute`` (llama.cpp's ``LlamaModel.permute``),
quantized rows are gguf-py's ``quantize``, and the expected floats are the arrays written (F32),
their float16 rounding (F16) or gguf-py's ``dequantize`` of the rows. Configs are built by hand
(``LlamaConfig(...)``); errors are matched whole, through the public functions (a test that
reached a function past mutmut's trampoline could not see its mutants).
"""

from __future__ import annotations

import json
import re
import time

import gguf
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import save_file
from tokenizers import pre_tokenizers

from magicpig_jax.io import loader
from magicpig_jax.io.gguf_model import (
    GGUFMetadataError,
    read_gguf,
    read_gguf_config,
    split_packed_key,
    unpermute_rope_rows,
)
from magicpig_jax.io.loader import build_llama, convert_model, load_model, read_model_config
from magicpig_jax.models.config import LlamaConfig, UnsupportedConfigError
from tests._gguf_rows import add_kv

H, HQ, HKV, D, F, NL = 32, 4, 2, 8, 64, 2
TOKENS = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "<|im_end|>"]
V = len(TOKENS)  # 258: the byte-level vocabulary, so a file's tokenizer fits its embedding exactly
EOS = V - 1
EPS = 2.0 ** -17  # exact in float32
Q8 = gguf.GGMLQuantizationType.Q8_0

_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter (``LlamaModel.permute``): the rotate-half halves of each head interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_weights(seed=0, *, vocab=V, bias=False, o_bias=False, qk_norm=False, tied=False) -> dict:
    rng = np.random.default_rng(seed)

    def r(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)

    w = {"model.embed_tokens.weight": r(vocab, H), "model.norm.weight": r(H)}
    if not tied:
        w["lm_head.weight"] = r(vocab, H)
    for i in range(NL):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": r(H), p + "post_attention_layernorm.weight": r(H),
              p + "self_attn.q_proj.weight": r(HQ * D, H), p + "self_attn.k_proj.weight": r(HKV * D, H),
              p + "self_attn.v_proj.weight": r(HKV * D, H), p + "self_attn.o_proj.weight": r(H, HQ * D),
              p + "mlp.gate_proj.weight": r(F, H), p + "mlp.up_proj.weight": r(F, H),
              p + "mlp.down_proj.weight": r(H, F)}
        if bias:
            w |= {p + "self_attn.q_proj.bias": r(HQ * D), p + "self_attn.k_proj.bias": r(HKV * D),
                  p + "self_attn.v_proj.bias": r(HKV * D)}
        if o_bias:
            w[p + "self_attn.o_proj.bias"] = r(H)
        if qk_norm:
            w |= {p + "self_attn.q_norm.weight": r(D), p + "self_attn.k_norm.weight": r(D)}
    return w


def _gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, i, rest = name.split(".", 3)
        return f"blk.{i}.{_LAYER[rest]}"
    return _GLOBAL[name]


def _base_kv(arch: str) -> dict:
    return {f"{arch}.block_count": NL, f"{arch}.context_length": 96, f"{arch}.embedding_length": H,
            f"{arch}.feed_forward_length": F, f"{arch}.attention.head_count": HQ,
            f"{arch}.attention.head_count_kv": HKV, f"{arch}.attention.layer_norm_rms_epsilon": EPS,
            f"{arch}.rope.freq_base": 5000.0,
            "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": TOKENS,
            "tokenizer.ggml.merges": ["Ġ t"], "tokenizer.ggml.token_type": [1] * (V - 1) + [3],
            "tokenizer.ggml.eos_token_id": EOS}


class _Writer(gguf.GGUFWriter):
    """GGUFWriter that leaves out the keys in ``skip`` (``general.architecture`` too)."""

    def __init__(self, path, arch, skip):
        self._skip = set(skip)
        super().__init__(str(path), arch)

    def add_key_value(self, key, val, vtype, sub_type=None):
        if key not in self._skip:
            super().add_key_value(key, val, vtype, sub_type)


def _write(path, arch="llama", weights=None, types=None, kv=None, skip=(), drop=(), tensors=None, permute=None,
           tensors_first=False):
    """A GGUF of Hugging Face ``weights`` (q/k rows permuted for ``llama``), each stored as
    ``types[name]`` ("F16", "Q8_0"; F32 otherwise), the metadata ``_base_kv`` updated by ``kv``
    (None values dropped), metadata ``skip``ped, weights in ``drop`` left out, and more raw
    ``tensors`` (GGUF name -> array, or (rows, type)), after the weights or before them."""
    w = _Writer(path, arch, skip)
    for key, value in ({**_base_kv(arch), **(kv or {})}).items():
        if value is None or key in skip:
            continue
        add_kv(w, key, value)
    permute = arch == "llama" if permute is None else permute
    if tensors_first:
        _add_tensors(w, tensors)
    for name, value in (weights or {}).items():
        if name in drop:
            continue
        if permute and (".q_proj." in name or ".k_proj." in name):
            value = _permute(value, HQ if ".q_proj." in name else HKV)
        qtype = (types or {}).get(name)
        if qtype == "F16":
            w.add_tensor(_gguf_name(name), value.astype(np.float16))
        elif qtype is not None:
            t = gguf.GGMLQuantizationType[qtype]
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(value, t), raw_dtype=t)
        else:
            w.add_tensor(_gguf_name(name), value)
    if not tensors_first:
        _add_tensors(w, tensors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _add_tensors(w, tensors):
    for gname, value in (tensors or {}).items():
        if isinstance(value, tuple):  # (raw rows, their GGUF type)
            w.add_tensor(gname, value[0], raw_dtype=gguf.GGMLQuantizationType[value[1]])
        else:
            w.add_tensor(gname, value)


def _f16_rows(w):
    return w.astype(np.float16).view(np.uint8).reshape(w.shape[0], -1)


def _q8_rows(w):
    return gguf.quants.quantize(w, Q8)


def _dq(rows, qtype):
    return np.asarray(gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[qtype]), np.float32)


def _raises(exc, message):
    return pytest.raises(exc, match="^" + re.escape(message) + "$")


def _llama_config(**kw) -> LlamaConfig:
    base = dict(vocab_size=V, hidden_size=H, intermediate_size=F, num_layers=NL, num_heads=HQ, num_kv_heads=HKV,
                head_dim=D, rope_theta=5000.0, rms_norm_eps=EPS, max_position_embeddings=96,
                tie_word_embeddings=False, eos_token_ids=(EOS,))
    return LlamaConfig(**{**base, **kw})


# -- read_gguf: the mapping, its types and the permutation ------------------------------------------

_MIXED = {  # layer 0: F16, Q8_0 and F32 matrices; layer 1: F32 q, F16 k, Q8_0 v, an F16 vector
    "model.embed_tokens.weight": "Q8_0",
    "model.layers.0.self_attn.q_proj.weight": "F16", "model.layers.0.self_attn.k_proj.weight": "Q8_0",
    "model.layers.0.self_attn.v_proj.weight": "Q8_0", "model.layers.0.mlp.gate_proj.weight": "Q8_0",
    "model.layers.0.mlp.up_proj.weight": "Q8_0", "model.layers.0.mlp.down_proj.weight": "F16",
    "model.layers.1.self_attn.k_proj.weight": "F16", "model.layers.1.self_attn.v_proj.weight": "Q8_0",
    "model.layers.1.input_layernorm.weight": "F16", "model.norm.weight": "Q8_0",  # two vectors, dequantized
}


def test_read_gguf_llama_weights_types_permutation_metadata_and_factors(tmp_path):
    hf = _hf_weights(1, bias=True, o_bias=True)
    factors = np.array([1.0, 2.0, 4.0, 0.5], np.float32)
    path = _write(tmp_path / "m.gguf", weights=hf, types=_MIXED,
                  kv={"tokenizer.ggml.eot_token_id": 9, "tokenizer.ggml.eom_token_id": EOS,
                      "tokenizer.chat_template": "{{ x }}", "tokenizer.chat_template.tool_use": "{{ y }}",
                      "general.name": "tiny", "qwen2.context_length": 5},
                  tensors={"rope_freqs.weight": factors}, tensors_first=True)  # first, as llama.cpp writes it
    config, weights, meta, freq = read_gguf(path)
    assert config == _llama_config(eos_token_ids=(EOS, 9), qkv_bias=True, o_bias=True)
    np.testing.assert_array_equal(freq, factors)
    assert freq.dtype == np.float32 and freq.shape == (4,)
    assert meta == {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": TOKENS,
                    "tokenizer.ggml.merges": ["Ġ t"], "tokenizer.ggml.token_type": [1] * (V - 1) + [3],
                    "tokenizer.ggml.eos_token_id": EOS, "tokenizer.ggml.eot_token_id": 9,
                    "tokenizer.ggml.eom_token_id": EOS, "tokenizer.chat_template": "{{ x }}",
                    "tokenizer.chat_template.tool_use": "{{ y }}",
                    "general.name": "tiny"}  # llama.cpp sets some token attributes by the model's name
    expected = {}
    for name, value in hf.items():
        qtype = _MIXED.get(name)
        if qtype == "Q8_0" and value.ndim == 2:
            expected[name + "_q8_0"] = (_q8_rows(value), "Q8_0")
        elif qtype == "F16" and value.ndim == 2:
            expected[name + "_f16"] = (_f16_rows(value), "F16")
        elif qtype == "Q8_0":
            expected[name] = (_dq(_q8_rows(value), "Q8_0"), "Q8_0")
        elif qtype == "F16":
            expected[name] = (value.astype(np.float16).astype(np.float32), "F16")
        else:
            expected[name] = (value, "F32")
    assert sorted(weights) == sorted(expected) and len(weights) == len(expected)
    for key, (value, qtype) in expected.items():
        got = weights[key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        np.testing.assert_array_equal(got, value, err_msg=key)
        assert weights.qtype(key) == qtype and key in weights
    assert "model.layers.0.self_attn.q_proj.weight" not in weights
    with _raises(TypeError, "GGUFWeights is read-only (keys can only be deleted)"):
        weights["x"] = np.zeros(1)
    del weights["model.layers.0.input_layernorm.weight"]
    assert "model.layers.0.input_layernorm.weight" not in weights and len(weights) == len(expected) - 1
    assert read_gguf_config(path) == config


def test_read_gguf_qwen_rows_are_not_permuted_and_their_tensors(tmp_path):
    hf = _hf_weights(2, bias=True)
    types = {"model.layers.0.self_attn.q_proj.weight": "F16", "model.layers.0.self_attn.k_proj.weight": "Q8_0"}
    # a matrix in a type the model does not hold as rows (IQ4_NL, 18-byte blocks of 32): dequantized,
    # with 16 rows of one block each (rows split anywhere else would cut the blocks)
    iq4 = np.random.default_rng(0).integers(0, 256, (HKV * D, 18), dtype=np.uint8)
    iq4[:, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    k1 = "model.layers.1.self_attn.k_proj.weight"
    config, weights, _, freq = read_gguf(_write(tmp_path / "q2.gguf", "qwen2", hf, types, drop=[k1],
                                                tensors={"blk.1.attn_k.weight": (iq4, "IQ4_NL")}))
    assert weights.qtype(k1) == "IQ4_NL" and weights[k1].dtype == np.float32
    np.testing.assert_array_equal(weights[k1], _dq(iq4, "IQ4_NL"))
    assert config == _llama_config(qkv_bias=True) and freq is None
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.q_proj.weight_f16"],
                                  _f16_rows(hf["model.layers.0.self_attn.q_proj.weight"]))
    np.testing.assert_array_equal(weights["model.layers.0.self_attn.k_proj.weight_q8_0"],
                                  _q8_rows(hf["model.layers.0.self_attn.k_proj.weight"]))
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.bias"):
        np.testing.assert_array_equal(weights[name], hf[name])
    # qwen3: q/k norms, tied embeddings (no output.weight)
    hf3 = _hf_weights(3, qk_norm=True, tied=True)
    config, weights, _, _ = read_gguf(_write(tmp_path / "q3.gguf", "qwen3", hf3))
    assert config == _llama_config(qk_norm=True, tie_word_embeddings=True)
    assert sorted(weights) == sorted(hf3)
    for name, value in hf3.items():
        np.testing.assert_array_equal(weights[name], value)
    # what each architecture may not hold
    p = tmp_path / "rf.gguf"
    with _raises(UnsupportedConfigError, f"unexpected tensor rope_freqs.weight in {p} for a qwen2 model"):
        read_gguf(_write(p, "qwen2", hf, tensors={"rope_freqs.weight": np.ones(4, np.float32)}))
    p = tmp_path / "b3.gguf"
    with _raises(UnsupportedConfigError, f"unexpected tensor blk.0.attn_q.bias in {p} for a qwen3 model"):
        read_gguf(_write(p, "qwen3", hf3, tensors={"blk.0.attn_q.bias": np.ones(HQ * D, np.float32)}))
    p = tmp_path / "nob.gguf"
    with _raises(UnsupportedConfigError, f"{p}: a qwen2 model needs q/k/v biases; blk.0.attn_q.bias is missing"):
        read_gguf(_write(p, "qwen2", _hf_weights(2)))
    p = tmp_path / "non.gguf"
    with _raises(UnsupportedConfigError, f"{p}: a qwen3 model needs q/k norms; blk.0.attn_q_norm.weight is missing"):
        read_gguf(_write(p, "qwen3", _hf_weights(3)))


@pytest.mark.parametrize("gname", ["blk.2.attn_norm.weight", "blk.x.attn_norm.weight", "blk.0.attn_sinks.weight",
                                   "output_norm.bias"])
def test_read_gguf_refuses_tensors_it_does_not_use(tmp_path, gname):
    p = tmp_path / "t.gguf"
    with _raises(UnsupportedConfigError, f"unexpected tensor {gname} in {p} for a llama model"):
        read_gguf(_write(p, weights=_hf_weights(), tensors={gname: np.ones(H, np.float32)}))


def test_gguf_weights_read_when_accessed_and_a_truncated_file(tmp_path):
    path = _write(tmp_path / "m.gguf", weights=_hf_weights(4))
    _, weights, _, _ = read_gguf(path)
    last = gguf.GGUFReader(str(path)).tensors[-1]  # blk.1.ffn_down.weight, the last in the file
    assert last.name == "blk.1.ffn_down.weight"
    offset, n_bytes = int(last.data_offset), int(last.n_bytes)
    with open(path, "r+b") as f:
        f.truncate(offset + n_bytes - 8)
    with _raises(ValueError, f"{path} is truncated: tensor model.layers.1.mlp.down_proj.weight needs {n_bytes} "
                             f"bytes at offset {offset}"):
        weights["model.layers.1.mlp.down_proj.weight"]
    np.testing.assert_array_equal(weights["model.norm.weight"], _hf_weights(4)["model.norm.weight"])


@given(st.integers(1, 6), st.integers(1, 5), st.sampled_from([(), (3,), (2, 5)]))
def test_unpermute_rope_rows_inverts_llama_cpps_permutation(n_head, half, rest):
    rows = n_head * 2 * half
    w = np.arange(rows * int(np.prod(rest)), dtype=np.float64).reshape(rows, *rest)
    np.testing.assert_array_equal(unpermute_rope_rows(_permute(w, n_head), n_head), w)


def test_packed_keys_split_for_every_type():
    for qtype in ("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"):
        assert split_packed_key(f"a.b.weight_{qtype.lower()}") == ("a.b.weight", qtype)
    assert split_packed_key("a.b.weight") == ("a.b.weight", None)
    assert split_packed_key("a.b.weight_Q8_0") == ("a.b.weight_Q8_0", None)


# -- the header: config fields, defaults and refusals ------------------------------------------------

def _header(tmp_path, name="h.gguf", arch="llama", kv=None, skip=(), q_rows=HQ * D, embd=True):
    tensors = {"token_embd.weight": np.zeros((V, H), np.float32)} if embd else {}
    if q_rows:
        tensors["blk.0.attn_q.weight"] = np.zeros((q_rows, H), np.float32)
    return _write(tmp_path / name, arch, kv=kv, skip=skip, tensors=tensors)


def test_read_gguf_config_fields_and_defaults(tmp_path):
    c = read_gguf_config(_header(tmp_path, kv={"llama.attention.head_count_kv": None, "llama.rope.freq_base": None,
                                               "llama.vocab_size": V, "llama.attention.value_length": D,
                                               "llama.rope.dimension_count": D, "llama.rope.scaling.type": "none",
                                               "llama.attention.sliding_window": 0, "general.type": "model",
                                               "split.count": 1, "llama.expert_count": 0,
                                               "llama.expert_used_count": 0,
                                               "tokenizer.ggml.eos_token_id": None}))
    assert c == _llama_config(num_kv_heads=HQ, rope_theta=10000.0, eos_token_ids=(), tie_word_embeddings=True)
    # the head dim from the q rows (12 = 48 / 4, not hidden / heads = 8), or from key_length
    c = read_gguf_config(_header(tmp_path, "k.gguf", q_rows=HQ * 12, kv={"llama.attention.sliding_window": 48,
                                                                       "tokenizer.ggml.eot_token_id": 9,
                                                                       "tokenizer.ggml.eom_token_id": 11}))
    assert (c.head_dim, c.sliding_window, c.eos_token_ids) == (12, 48, (EOS, 9, 11))
    c = read_gguf_config(_header(tmp_path, "kl.gguf", q_rows=HQ * 12, kv={"llama.attention.key_length": 6}))
    assert c.head_dim == 6
    c = read_gguf_config(_header(tmp_path, "nq.gguf", q_rows=0, kv={"tokenizer.ggml.eos_token_id": None,
                                                                   "tokenizer.ggml.eot_token_id": 3}))
    assert (c.head_dim, c.eos_token_ids) == (H // HQ, (3,))
    c = read_gguf_config(_header(tmp_path, "lin.gguf", kv={"llama.rope.scaling.type": "linear",
                                                         "llama.rope.scaling.factor": 4.0}))
    assert c.rope_scaling == (("factor", 4.0), ("rope_type", "linear"))


def test_read_gguf_config_refusals_name_the_key(tmp_path):
    def refused(exc, message_of, **kwargs):
        path = tmp_path / f"r{len(list(tmp_path.iterdir()))}.gguf"
        _header(tmp_path, path.name, **kwargs)
        with _raises(exc, message_of(path)):
            read_gguf_config(path)
        with _raises(exc, message_of(path)):
            read_gguf(path)

    for key in ("attention.head_count", "embedding_length", "block_count", "feed_forward_length",
                "attention.layer_norm_rms_epsilon", "context_length"):
        refused(GGUFMetadataError,
                lambda p, key=key: f"{p} has no 'llama.{key}' metadata key, which a llama model needs",
                skip=[f"llama.{key}"])
    refused(GGUFMetadataError, lambda p: f"{p} has no 'llama.rope.scaling.factor' metadata key, which a llama model "
                                         "needs", kv={"llama.rope.scaling.type": "linear"})
    refused(GGUFMetadataError, lambda p: f"{p} has no 'general.architecture' metadata key",
            skip=["general.architecture"])
    refused(UnsupportedConfigError, lambda p: f"unsupported GGUF architecture 'gpt2' in {p}; supported: llama, qwen2, "
                                              "qwen3, smollm3, phi3, gemma2, gemma3", arch="gpt2")
    refused(UnsupportedConfigError, lambda p: f"{p} has no token_embd.weight tensor", embd=False)
    refused(GGUFMetadataError, lambda p: f"{p}: llama.vocab_size = 300 but token_embd.weight has {V} rows",
            kv={"llama.vocab_size": 300})
    refused(UnsupportedConfigError, lambda p: f"{p}: llama.attention.value_length = 4 differs from the key length {D}",
            kv={"llama.attention.value_length": 4})
    refused(UnsupportedConfigError, lambda p: f"{p}: llama.rope.dimension_count = 4 < head dim {D}: partial RoPE is "
                                              "not implemented for llama", kv={"llama.rope.dimension_count": 4})
    refused(UnsupportedConfigError, lambda p: f"{p}: llama.rope.scaling.type = 'longrope' is not implemented "
                                              "(supported: none, linear, yarn; Llama 3.1 scaling comes as the "
                                              "rope_freqs.weight tensor)",
            kv={"llama.rope.scaling.type": "longrope"})
    refused(UnsupportedConfigError, lambda p: f"{p}: llama.rope.scaling.yarn_beta_fast = 16.0 is not supported "
                                              "(llama.cpp does not read it for llama models and uses 32.0)",
            kv={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                "llama.rope.scaling.yarn_beta_fast": 16.0})
    refused(UnsupportedConfigError, lambda p: f"{p} is a GGUF 'adapter' (general.type), not a model",
            kv={"general.type": "adapter"})
    refused(UnsupportedConfigError, lambda p: f"{p} is one part of a split GGUF (split.count = 2); merge the parts "
                                              "first (llama-gguf-split --merge)", kv={"split.count": 2})
    refused(UnsupportedConfigError, lambda p: f"{p}: metadata key(s) 'llama.attention.clamp_kqv', 'llama.foo', "
                                              "'tokenizer.ggml.precompiled_charsmap' are not implemented (they may "
                                              "change the computation)",
            kv={"tokenizer.ggml.precompiled_charsmap": "x", "llama.foo": 1, "llama.attention.clamp_kqv": 8.0})
    for key in ("expert_count", "expert_used_count"):
        refused(UnsupportedConfigError, lambda p, key=key: f"{p}: llama.{key} = 2: mixture-of-experts models are not "
                                                           "supported", kv={f"llama.{key}": 2})


def test_open_reader_errors(tmp_path):
    missing = tmp_path / "none.gguf"
    with _raises(FileNotFoundError, f"model file {missing} does not exist"):
        read_gguf(missing)
    with _raises(FileNotFoundError, f"model file {tmp_path} is not a regular file (a .gguf file was expected)"):
        read_gguf_config(tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUG" + b"\0" * 60)
    with _raises(ValueError, f"{junk} is not a GGUF file (it does not start with the GGUF magic)"):
        read_gguf(junk)
    for size in (0, 3):  # a prefix of the magic: a cut copy, named by its size
        stub = tmp_path / f"stub{size}.gguf"
        stub.write_bytes(b"GGUF"[:size])
        with _raises(ValueError, f"{stub} is a truncated GGUF file ({size} bytes; its header alone needs 24)"):
            read_gguf_config(stub)
    full = _header(tmp_path, "full.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full.read_bytes()[:-4096])
    size = cut.stat().st_size
    with pytest.raises(ValueError, match="^" + re.escape(f"{cut} is a truncated GGUF file ({size} bytes; its header "
                                                         "and tensors need more), or its header is corrupt: ") + ".+"):
        read_gguf_config(cut)
    data = full.read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:10])
    with _raises(ValueError, f"{short} is a truncated GGUF file (10 bytes; its header alone needs 24)"):
        read_gguf(short)
    v9 = tmp_path / "v9.gguf"
    v9.write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with _raises(ValueError, f"{v9}: GGUF version 9 is not supported (2 or 3)"):
        read_gguf(v9)
    huge = tmp_path / "huge.gguf"
    huge.write_bytes(data[:8] + (2**63).to_bytes(8, "little") + data[16:])
    with _raises(ValueError, f"{huge} has a corrupt GGUF header (tensor_count = {2**63} in a file of {len(data)} "
                             "bytes)"):
        read_gguf(huge)


# -- build_llama --------------------------------------------------------------------------------------

def _assert_module_holds(module, hf: dict, dtype=np.float32):
    """Every float parameter of ``module`` equals ``hf``'s weight (kernels transposed)."""
    def same(param, value):
        got = np.asarray(param[...])
        assert got.dtype == dtype
        np.testing.assert_array_equal(got.astype(np.float32), value.astype(dtype).astype(np.float32))

    if "model.embed_tokens.weight" in hf:
        same(module.embed_tokens.embedding, hf["model.embed_tokens.weight"])
    same(module.norm.weight, hf["model.norm.weight"])
    if "lm_head.weight" in hf:
        same(module.lm_head.kernel, hf["lm_head.weight"].T)
    for i, layer in enumerate(module.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        same(layer.input_layernorm.weight, hf[p + "input_layernorm.weight"])
        same(layer.post_attention_layernorm.weight, hf[p + "post_attention_layernorm.weight"])
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            if p + f"self_attn.{proj}.weight" in hf:
                same(getattr(attn, proj).kernel, hf[p + f"self_attn.{proj}.weight"].T)
            if p + f"self_attn.{proj}.bias" in hf:
                same(getattr(attn, proj[0] + "_bias"), hf[p + f"self_attn.{proj}.bias"])
        for proj in ("gate_proj", "up_proj", "down_proj"):
            if p + f"mlp.{proj}.weight" in hf:
                same(getattr(mlp, proj).kernel, hf[p + f"mlp.{proj}.weight"].T)
        if p + "self_attn.q_norm.weight" in hf:
            same(attn.q_norm.weight, hf[p + "self_attn.q_norm.weight"])
            same(attn.k_norm.weight, hf[p + "self_attn.k_norm.weight"])


def _inv_freq(theta, factors=None):
    inv = 1.0 / theta ** (np.arange(0, D, 2) / D)
    return (inv if factors is None else inv / factors).astype(np.float32)


def test_build_llama_places_every_float_weight(tmp_path):
    import jax.numpy as jnp

    hf = _hf_weights(5, bias=True, o_bias=True, qk_norm=True)
    config = _llama_config(qkv_bias=True, o_bias=True, qk_norm=True)
    factors = np.array([1.0, 3.0, 0.5, 8.0], np.float32)
    weights = dict(hf)
    module = build_llama(config, weights, factors)
    assert sorted(weights) == sorted(hf)  # not consumed by default
    _assert_module_holds(module, hf)
    np.testing.assert_allclose(np.asarray(module.inv_freq[...]), _inv_freq(5000.0, factors), rtol=1e-7)
    assert module.embed_packed is None and module.lm_head.packed is None
    # bfloat16 parameters, each entry deleted once placed
    module = build_llama(config, weights, dtype=jnp.bfloat16, consume=True)
    assert weights == {}
    _assert_module_holds(module, hf, jnp.bfloat16)
    rows = module.embed(jnp.asarray([[3, 0]], jnp.int32))  # the embedding computes in its dtype too
    assert rows.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(rows[0], np.float32),
                                  hf["model.embed_tokens.weight"][[3, 0]].astype(jnp.bfloat16).astype(np.float32))
    np.testing.assert_allclose(np.asarray(module.inv_freq[...]), _inv_freq(5000.0), rtol=1e-7)
    # tied embeddings: no lm_head
    hf = _hf_weights(6, tied=True)
    module = build_llama(_llama_config(tie_word_embeddings=True), dict(hf))
    assert module.lm_head is None
    _assert_module_holds(module, hf)


def _rows(module_var):
    return np.asarray(module_var[...])


def test_build_llama_holds_gguf_rows_stacked_per_type(tmp_path):
    hf = _hf_weights(7)
    L0, L1 = "model.layers.0.", "model.layers.1."
    packed = {  # name -> (qtype, rows)
        "model.embed_tokens.weight": "Q8_0", "lm_head.weight": "Q8_0",
        L0 + "self_attn.q_proj.weight": "Q8_0", L0 + "self_attn.k_proj.weight": "Q8_0",
        L0 + "self_attn.v_proj.weight": "Q8_0", L0 + "self_attn.o_proj.weight": "Q8_0",
        L0 + "mlp.gate_proj.weight": "F16", L0 + "mlp.up_proj.weight": "F16", L0 + "mlp.down_proj.weight": "F16",
        L1 + "self_attn.q_proj.weight": "Q8_0", L1 + "self_attn.k_proj.weight": "F16",  # mixed: one by one
        L1 + "self_attn.v_proj.weight": "Q8_0", L1 + "mlp.gate_proj.weight": "Q8_0",  # up stays float
    }
    rows = {n: (_q8_rows(hf[n]) if t == "Q8_0" else _f16_rows(hf[n])) for n, t in packed.items()}
    weights = {n: v for n, v in hf.items() if n not in packed}
    weights |= {f"{n}_{t.lower()}": rows[n] for n, t in packed.items()}
    # an old checkpoint holding o_proj of layer 1 twice (float and rows): the rows are taken
    o1 = L1 + "self_attn.o_proj.weight"
    weights[o1 + "_q8_0"] = rows[o1] = _q8_rows(hf[o1] * 2)
    # a second form of a weight that is placed anyway is not "unused"
    weights[L1 + "mlp.gate_proj.weight_f16"] = _f16_rows(hf[L1 + "mlp.gate_proj.weight"])
    module = build_llama(_llama_config(), dict(weights))  # packed_weights=True by default
    a0, m0, a1, m1 = module.layers[0].self_attn, module.layers[0].mlp, module.layers[1].self_attn, module.layers[1].mlp
    assert (module.embed_qtype, module.lm_head.qtype, a0.qkv_qtype, m0.gate_up_qtype) == ("Q8_0",) * 3 + ("F16",)
    np.testing.assert_array_equal(_rows(module.embed_packed), rows["model.embed_tokens.weight"])
    assert module.embed_tokens is None
    np.testing.assert_array_equal(_rows(module.lm_head.packed), rows["lm_head.weight"])
    np.testing.assert_array_equal(_rows(a0.qkv_packed), np.concatenate(
        [rows[L0 + f"self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]))
    np.testing.assert_array_equal(_rows(m0.gate_up_packed), np.concatenate(
        [rows[L0 + f"mlp.{p}.weight"] for p in ("gate_proj", "up_proj")]))
    assert a0.q_proj.packed is None and m0.gate_proj.packed is None
    for linear, name, qtype in ((a0.o_proj, L0 + "self_attn.o_proj.weight", "Q8_0"),
                                (m0.down_proj, L0 + "mlp.down_proj.weight", "F16"),
                                (a1.q_proj, L1 + "self_attn.q_proj.weight", "Q8_0"),
                                (a1.k_proj, L1 + "self_attn.k_proj.weight", "F16"),
                                (a1.v_proj, L1 + "self_attn.v_proj.weight", "Q8_0"), (a1.o_proj, o1, "Q8_0"),
                                (m1.gate_proj, L1 + "mlp.gate_proj.weight", "Q8_0")):
        assert linear.qtype == qtype, name
        np.testing.assert_array_equal(_rows(linear.packed), rows[name], err_msg=name)
    assert a1.qkv_packed is None and m1.gate_up_packed is None and m1.up_proj.packed is None
    _assert_module_holds(module, {n: v for n, v in hf.items() if n not in packed and n != o1})
    # consumed: every entry, both forms of o_proj too (not the second rows of gate_proj, never read)
    left = dict(weights)
    build_llama(_llama_config(), left, consume=True)
    assert list(left) == [L1 + "mlp.gate_proj.weight_f16"]
    # packed_weights=False: gguf-py's dequantization, and the float form where both are held
    left = dict(weights)
    module = build_llama(_llama_config(), left, packed_weights=False, consume=True)
    assert list(left) == [L1 + "mlp.gate_proj.weight_f16"]
    assert module.embed_packed is None and module.layers[0].self_attn.qkv_packed is None
    deq = {n: _dq(rows[n], t) for n, t in packed.items()}
    deq[o1] = hf[o1]
    _assert_module_holds(module, {**hf, **deq})
    assert all(getattr(module.layers[i].self_attn, p).packed is None for i in (0, 1) for p in ("q_proj", "o_proj"))


def test_build_llama_messages(tmp_path):
    config = _llama_config()
    hf = _hf_weights(8)
    missing = dict(hf)
    del missing["model.layers.1.mlp.down_proj.weight"]
    with _raises(ValueError, "weight 'model.layers.1.mlp.down_proj.weight' missing from the checkpoint"):
        build_llama(config, missing)
    with _raises(ValueError, "weight 'model.norm.weight' has shape (31,), expected (32,)"):
        build_llama(config, {**hf, "model.norm.weight": np.ones(31, np.float32)})
    # a kernel is compared after its transpose
    with _raises(ValueError, "weight 'model.layers.0.self_attn.k_proj.weight' has shape (16, 32), expected (32, 16)"):
        build_llama(config, {**hf, "model.layers.0.self_attn.k_proj.weight": np.ones((H, HKV * D), np.float32)})
    extra = {f"model.extra.{c}.weight": np.ones(1, np.float32) for c in "abcdefghi"}
    with _raises(ValueError, "the checkpoint has weights this LlamaConfig does not use: " + ", ".join(
            f"model.extra.{c}.weight" for c in "abcdefgh") + " (and 1 more); refusing to load a model whose "
            "computation would differ"):
        build_llama(config, {**hf, **extra})
    eight = {k: v for k, v in extra.items() if k != "model.extra.i.weight"}
    with _raises(ValueError, "the checkpoint has weights this LlamaConfig does not use: " + ", ".join(sorted(eight))
                 + "; refusing to load a model whose computation would differ"):
        build_llama(config, {**hf, **eight})
    # rows of a name the model does not have, and a bias it does not declare
    with _raises(ValueError, "the checkpoint has weights this LlamaConfig does not use: "
                 "model.layers.0.self_attn.q_proj.bias, model.x.weight (Q8_0); refusing to load a model whose "
                 "computation would differ"):
        build_llama(config, {**hf, "model.x.weight_q8_0": np.zeros((1, 34), np.uint8),
                             "model.layers.0.self_attn.q_proj.bias": np.ones(HQ * D, np.float32)})


# -- load_model, read_model_config, convert_model ------------------------------------------------------

def _hf_dir(folder, hf, **config):
    from magicpig_jax.io.tokenizer import Tokenizer

    folder.mkdir()
    save_file(hf, str(folder / "model.safetensors"))
    cfg = {"model_type": "llama", "vocab_size": V, "hidden_size": H, "intermediate_size": F,
           "num_hidden_layers": NL, "num_attention_heads": HQ, "num_key_value_heads": HKV, "head_dim": D,
           "rope_theta": 5000.0, "rms_norm_eps": EPS, "max_position_embeddings": 96, "tie_word_embeddings": False,
           "eos_token_id": 5, **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    meta = {k: v for k, v in _base_kv("llama").items() if k.startswith("tokenizer.")}
    meta.pop("tokenizer.ggml.eos_token_id")
    Tokenizer.from_gguf_metadata(meta).backend.save(str(folder / "tokenizer.json"))
    return folder


def test_load_model_and_read_model_config_of_a_gguf_and_a_directory(tmp_path):
    hf = _hf_weights(9)
    factors = np.array([2.0, 1.0, 1.0, 4.0], np.float32)
    path = _write(tmp_path / "m.gguf", weights=hf, types={"model.layers.0.self_attn.o_proj.weight": "Q8_0"},
                  tensors={"rope_freqs.weight": factors})
    t0 = time.perf_counter()
    loaded = load_model(path)
    elapsed = time.perf_counter() - t0
    assert 0 < loaded.load_seconds <= elapsed
    assert loaded.source == path and loaded.config == _llama_config() == read_model_config(path)
    assert loaded.tokenizer.eos_token_ids == (EOS,) and loaded.tokenizer.encode(" t") == [256]
    np.testing.assert_array_equal(_rows(loaded.module.layers[0].self_attn.o_proj.packed),
                                  _q8_rows(hf["model.layers.0.self_attn.o_proj.weight"]))
    np.testing.assert_allclose(np.asarray(loaded.module.inv_freq[...]), _inv_freq(5000.0, factors), rtol=1e-7)
    _assert_module_holds(loaded.module, {n: v for n, v in hf.items() if "layers.0.self_attn.o_proj" not in n})
    plain = load_model(str(path), packed_weights=False)
    assert plain.module.layers[0].self_attn.o_proj.packed is None
    np.testing.assert_array_equal(np.asarray(plain.module.layers[0].self_attn.o_proj.kernel[...]),
                                  _dq(_q8_rows(hf["model.layers.0.self_attn.o_proj.weight"]), "Q8_0").T)
    # a Hugging Face directory: its config's stop id reaches the tokenizer
    folder = _hf_dir(tmp_path / "hf", hf)
    loaded = load_model(folder)
    assert loaded.source == folder and loaded.config == _llama_config(eos_token_ids=(5,)) == read_model_config(folder)
    assert loaded.tokenizer.eos_token_ids == (5,)
    _assert_module_holds(loaded.module, hf)
    np.testing.assert_allclose(np.asarray(loaded.module.inv_freq[...]), _inv_freq(5000.0), rtol=1e-7)
    # the tokenizer's added tokens count: one past the model's vocabulary is refused
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    extra = _hf_dir(tmp_path / "extra", hf)
    backend = HFTokenizer.from_file(str(extra / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<extra>", normalized=False)])
    backend.save(str(extra / "tokenizer.json"))
    with _raises(ValueError, f"{extra}: the tokenizer has {V + 1} tokens but the model's vocabulary only {V}"):
        load_model(extra)
    # the vocabulary must hold the tokenizer's 258 tokens
    small = _hf_weights(9, vocab=V - 1)
    p = _write(tmp_path / "small.gguf", weights=small)
    with _raises(ValueError, f"{p}: the tokenizer has {V} tokens but the model's vocabulary only {V - 1}"):
        load_model(p)


def test_load_model_consumes_the_weights_it_read(tmp_path, monkeypatch):
    """Each weight is deleted from what the source returned once it is placed (never held twice)."""
    hf = _hf_weights(12)
    weights = dict(hf)
    tok = object()
    monkeypatch.setattr(loader, "_read_source", lambda path: (tmp_path, (_llama_config(), weights, tok, None)))
    loaded = load_model(tmp_path)
    assert weights == {} and loaded.tokenizer is tok
    _assert_module_holds(loaded.module, hf)


def test_loader_paths_messages_and_the_embedded_model(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    message = (f"model path {missing} does not exist (expected a .gguf file, a Hugging Face directory or a "
               "checkpoint directory written by magicpig-jax convert)")
    with _raises(FileNotFoundError, message):
        load_model(missing)
    with _raises(FileNotFoundError, message):
        read_model_config(missing)
    with _raises(FileNotFoundError, message):
        convert_model(missing, tmp_path / "out")
    empty = tmp_path / "empty"
    empty.mkdir()
    with _raises(FileNotFoundError, f"{empty / 'config.json'} not found: a Hugging Face model directory needs "
                                    "config.json"):
        read_model_config(empty)
    # None: the embedded model (here a tiny GGUF in its place)
    path = _write(tmp_path / "embedded.gguf", weights=_hf_weights(11))
    monkeypatch.setattr(loader, "embedded_model_path", lambda: path)
    assert read_model_config(None) == _llama_config()
    loaded = load_model(None)
    assert loaded.source == path and loaded.config == _llama_config()
    _assert_module_holds(loaded.module, _hf_weights(11))
    assert convert_model(None, tmp_path / "ckpt") == tmp_path / "ckpt"
    assert read_model_config(tmp_path / "ckpt") == _llama_config()


def test_convert_model_writes_what_it_read(tmp_path):
    from magicpig_jax.io.checkpoint import read_checkpoint

    hf = _hf_weights(10)
    factors = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    path = _write(tmp_path / "m.gguf", weights=hf, types={"model.layers.1.mlp.up_proj.weight": "Q8_0"},
                  tensors={"rope_freqs.weight": factors[None]})  # [1, D/2]: read flat
    out = convert_model(path, tmp_path / "ckpt")
    assert out == tmp_path / "ckpt"
    config, weights, tokenizer, freq = read_checkpoint(out)
    assert config == _llama_config() == read_model_config(out)
    np.testing.assert_array_equal(freq, factors)
    assert freq.shape == (D // 2,)
    assert tokenizer.eos_token_ids == (EOS,) and tokenizer.encode(" t") == [256]
    up = "model.layers.1.mlp.up_proj.weight"
    assert sorted(weights) == sorted([n for n in hf if n != up] + [up + "_q8_0"])
    np.testing.assert_array_equal(weights[up + "_q8_0"], _q8_rows(hf[up]))
    for name, value in hf.items():
        if name != up:
            np.testing.assert_array_equal(weights[name], value)
    loaded = load_model(out)
    assert loaded.source == out
    np.testing.assert_allclose(np.asarray(loaded.module.inv_freq[...]), _inv_freq(5000.0, factors), rtol=1e-7)


# -- Tokenizer.encode_chat with one special token -------------------------------------------------------

def _byte_ids(text: str) -> list[int]:
    """GPT-2's byte-to-character table (``bytes_to_unicode``), written out: the ids of a text in a
    byte-level vocabulary with no merge that applies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [TOKENS.index(chars[b]) for b in text.encode()]


def test_encode_chat_with_a_single_special_token_and_used_private_characters():
    from magicpig_jax.io.tokenizer import Tokenizer

    meta = {k: v for k, v in _base_kv("llama").items() if k.startswith("tokenizer.")}
    meta["tokenizer.chat_template"] = "{% for m in messages %}[{{ m.content }}]<|im_end|>{% endfor %}"
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tuple(tok.special_tokens) == ("<|im_end|>",)
    # the content holds every special string the tokenizer has: still literal
    assert tok.encode_chat([{"role": "user", "content": "a<|im_end|>"}]) == [*_byte_ids("[a<|im_end|>]"), EOS]
    # the first two candidates for a mark (U+F0000, and what follows it) are in the content
    content = "\U000f0000\x01\U000f0001b<|im_end|>"
    assert tok.encode_chat([{"role": "user", "content": content}]) == [*_byte_ids(f"[{content}]"), EOS]


def test_gguf_rope_scaling_as_llama_cpp_reads_it(tmp_path):
    """llama.cpp's reading (llama_model::load_hparams): an absent type is linear, factor 0 or type
    "none" is no scaling, the older rope.scale_linear key counts, and rope_freqs apply with the
    linear factor; each case gave llama.cpp's logits within 3e-5 in a llama-cpp-python differential."""
    linear4 = (("factor", 4.0), ("rope_type", "linear"))
    cases = [({"llama.rope.scaling.factor": 4.0}, linear4),
             ({"llama.rope.scale_linear": 4.0}, linear4),
             ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0}, None),
             ({"llama.rope.scaling.factor": 0.0}, None),
             ({"llama.rope.scaling.type": "none", "llama.rope.scaling.factor": 4.0}, None),
             ({"llama.attention.head_count_kv": [HKV, HKV]}, None)]
    for i, (kv, expected) in enumerate(cases):
        assert read_gguf_config(_header(tmp_path, f"s{i}.gguf", kv=kv)).rope_scaling == expected, kv
    for i, bad in enumerate((-1.0, float("nan"), float("inf"))):
        p = _header(tmp_path, f"b{i}.gguf", kv={"llama.rope.scaling.factor": bad})
        with _raises(GGUFMetadataError, f"{p}: llama.rope.scaling.factor = {bad!r} must be a finite number >= 0 "
                                        "(0: no scaling)"):
            read_gguf_config(p)
    p = _header(tmp_path, "dims.gguf", kv={"llama.rope.dimension_count": 2 * D})
    with _raises(GGUFMetadataError, f"{p}: llama.rope.dimension_count = {2 * D} exceeds the head dim {D}"):
        read_gguf_config(p)
    p = _header(tmp_path, "kv.gguf", kv={"llama.attention.head_count_kv": [HKV, 1]})
    with _raises(UnsupportedConfigError, f"{p}: llama.attention.head_count_kv = [{HKV}, 1] differs between layers; "
                                         "per-layer values are not implemented"):
        read_gguf_config(p)
    # rope_freqs and a linear factor together: both divide the frequencies (float64 reference)
    hf = _hf_weights(12)
    factors = np.array([1.0, 2.0, 4.0, 0.5], np.float32)
    path = _write(tmp_path / "fl.gguf", weights=hf, tensors={"rope_freqs.weight": factors},
                  kv={"llama.rope.scaling.factor": 4.0})
    inv = 1.0 / 5000.0 ** (np.arange(0, D, 2, dtype=np.float64) / D) / factors.astype(np.float64) / 4.0
    np.testing.assert_allclose(np.asarray(load_model(path).module.inv_freq[...]), inv, rtol=1e-7)
    for name, bad in (("len", np.ones(D, np.float32)), ("zero", np.array([1.0, 0.0, 1.0, 1.0], np.float32))):
        p = _write(tmp_path / f"{name}.gguf", weights=hf, tensors={"rope_freqs.weight": bad})
        message = (f"{p}: rope_freqs.weight has {D} entries; RoPE needs head dim / 2 = {D // 2}" if name == "len"
                   else f"{p}: rope_freqs.weight holds a factor that is not finite and > 0")
        with _raises(ValueError, message):
            read_gguf(p)
    # qwen2 has no output bias (llama.cpp and transformers)
    p = _write(tmp_path / "qo.gguf", "qwen2", _hf_weights(2, bias=True, o_bias=True))
    with _raises(UnsupportedConfigError, f"unexpected tensor blk.0.attn_output.bias in {p} for a qwen2 model"):
        read_gguf(p)


def test_rope_inv_freq_factors_with_scalings():
    from magicpig_jax.models.rope import rope_inv_freq

    base = _llama_config(rope_scaling=(("factor", 2.0), ("rope_type", "linear")))
    ff = np.array([1.0, 2.0, 3.0, 4.0])
    np.testing.assert_allclose(rope_inv_freq(base, ff), 1.0 / 5000.0 ** (np.arange(0, D, 2) / D) / ff / 2.0,
                               rtol=1e-7)
    with _raises(ValueError, "freq_factors must be [D/2] = [4] finite values > 0, got shape (3,)"):
        rope_inv_freq(base, ff[:3])
    llama3 = _llama_config(rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                                         ("original_max_position_embeddings", 8192), ("rope_type", "llama3")))
    with _raises(ValueError, "freq_factors cannot be combined with a 'llama3' RoPE scaling"):
        rope_inv_freq(llama3, ff)


def test_an_integer_weight_in_safetensors_is_refused(tmp_path):
    """An int8 weight (a quantized tensor without its scales) was cast to float32 and used as such."""
    hf = _hf_weights(3)
    name = "model.layers.0.mlp.down_proj.weight"
    hf[name] = np.clip(hf[name] * 100, -127, 127).astype(np.int8)
    folder = _hf_dir(tmp_path / "int8", hf)
    with pytest.raises(ValueError, match=re.escape(f"tensor {name!r} has dtype int8: only floating-point weights")):
        load_model(folder)


def test_rope_freqs_with_a_yarn_scaling_is_refused_from_the_header(tmp_path):
    """The metadata check (what the CLI runs first) refuses what the load would: rope_freqs.weight
    with a scaling other than linear."""
    path = tmp_path / "ry.gguf"
    _write(path, "llama", kv={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0},
           tensors={"token_embd.weight": np.zeros((V, H), np.float32),
                    "blk.0.attn_q.weight": np.zeros((HQ * D, H), np.float32),
                    "rope_freqs.weight": np.ones(D // 2, np.float32)})
    with _raises(UnsupportedConfigError, f"{path}: the rope_freqs.weight tensor with a 'yarn' RoPE scaling "
                                         "(llama.rope.scaling.type) is not implemented (only with none or linear)"):
        read_gguf_config(path)


def test_a_declared_end_token_llama_cpp_drops_is_no_stop_of_the_config(tmp_path):
    """A declared EOT ``<|end|>`` beside ``<|return|>`` and ``<|call|>`` (gpt-oss): llama.cpp takes it out
    of its stops, and so did the tokenizer, but the config kept it (the decoder stops at both lists')
    union, so it stopped at ``<|end|>``). A re-reviewer's finding."""
    from magicpig_jax.io.tokenizer import Tokenizer

    toks = list(TOKENS)
    types = [1] * (V - 1) + [3]
    for i, s in zip((100, 101, 102), ("<|return|>", "<|call|>", "<|end|>"), strict=True):
        toks[i], types[i] = s, 3
    kv = {"tokenizer.ggml.tokens": toks, "tokenizer.ggml.token_type": types, "tokenizer.ggml.eot_token_id": 102}
    path = _write(tmp_path / "m.gguf", weights=_hf_weights(1), kv=kv)
    cfg, _, meta, _ = read_gguf(path)
    assert 102 not in cfg.eos_token_ids and EOS in cfg.eos_token_ids
    assert read_gguf_config(path).eos_token_ids == cfg.eos_token_ids
    assert 102 not in Tokenizer.from_gguf_metadata(meta).eos_token_ids
    # without <|call|>, <|end|> stays a stop in both
    toks[101] = "<|other|>"
    path = _write(tmp_path / "n.gguf", weights=_hf_weights(1), kv=kv)
    assert 102 in read_gguf_config(path).eos_token_ids
