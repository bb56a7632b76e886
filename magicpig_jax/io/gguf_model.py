"""Read a Llama-family GGUF file with ``gguf``: config, dequantized weights, tokenizer metadata."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from magicpig_jax.io.gguf_blocks import QUANT_TYPES
from magicpig_jax.models.config import LlamaConfig

__all__ = ["read_gguf", "SUPPORTED_ARCHITECTURES", "unpermute_rope_rows", "packed_key"]

SUPPORTED_ARCHITECTURES = ("llama",)

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of q/k projections (``[n_head*D, in]``).

    llama.cpp's converter interleaves the two rotary halves of each head for its
    pairwise RoPE; the Hugging Face layout (rotate-half) is restored with
    ``n_head`` = query heads for q and KV heads for k.
    """
    out_dim = w.shape[0]
    head_dim = out_dim // n_head
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def packed_key(name: str, qtype: str) -> str:
    """Key of a weight's raw GGUF blocks in the weights dict: ``"<name>_<qtype>"``, lower case.

    E.g. ``model.layers.0.self_attn.q_proj.weight_q4_1`` (uint8 ``[Out, In/32*20]``).
    """
    return f"{name}_{qtype.lower()}"


def _field(reader, name, default=None):
    field = reader.fields.get(name)
    return default if field is None else field.contents()


def read_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray], dict, np.ndarray | None]:
    """Parse a GGUF file of a Llama-family model.

    Every tensor type that ``gguf.quants.dequantize`` knows (F32, F16, BF16, Q4_0,
    Q4_1, Q8_0, K-quants, ...) is dequantized to float32 in the Hugging Face
    ``(out, in)`` layout and naming (``model.layers.{i}.self_attn.q_proj.weight``...).
    Matrices stored as Q4_1 or Q8_0 also keep their raw blocks, uint8 ``[out, in/32 *
    block bytes]`` under :func:`packed_key` (rows in the same order as the float32
    weight), for the decode-time matvec of :mod:`magicpig_jax.host.matvec`.

    Returns:
      ``(config, weights, tokenizer_metadata, rope_freq_factors)``.

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a GGUF file, or ``general.architecture`` is not supported
        (the message lists the supported ones).
    """
    import gguf

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"model file {path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # gguf raises ValueError/struct errors on bad magic
        raise ValueError(f"{path} is not a readable GGUF file: {err}") from err
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r} in {path}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_head))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    tensors = {t.name: t for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is None and "blk.0.attn_q.weight" in tensors:
        key_length = int(tensors["blk.0.attn_q.weight"].shape[-1]) // n_head  # gguf shapes are (in, out)
    head_dim = int(key_length if key_length is not None else hidden // n_head)
    scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        scaling = (("factor", float(_field(reader, f"{arch}.rope.scaling.factor"))), ("rope_type", "linear"))
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eos_ids = [int(eos)] if eos is not None else []
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and int(eot) not in eos_ids:
        eos_ids.append(int(eot))
    config = LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_field(reader, f"{arch}.block_count")),
        num_heads=n_head,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        eos_token_ids=tuple(eos_ids),
    )
    weights: dict[str, np.ndarray] = {}
    freq_factors = None
    for name, t in tensors.items():
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        qtype = t.tensor_type.name
        blocks = np.asarray(t.data) if qtype in QUANT_TYPES and w.ndim == 2 else None
        if name == "rope_freqs.weight":
            freq_factors = w.reshape(-1)
            continue
        if name.startswith("blk."):
            _, idx, rest = name.split(".", 2)
            if rest not in _LAYER_NAMES:
                raise ValueError(f"unexpected tensor {name} in {path} for a Llama model")
            if rest in ("attn_q.weight", "attn_k.weight"):
                heads = n_head if rest == "attn_q.weight" else n_kv
                w = unpermute_rope_rows(w, heads)
                blocks = None if blocks is None else unpermute_rope_rows(blocks, heads)
            key = f"model.layers.{int(idx)}.{_LAYER_NAMES[rest]}"
        elif name in _GLOBAL_NAMES:
            key = _GLOBAL_NAMES[name]
        else:
            raise ValueError(f"unexpected tensor {name} in {path} for a Llama model")
        weights[key] = w
        if blocks is not None:
            weights[packed_key(key, qtype)] = blocks
    meta = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    return config, weights, meta, freq_factors
