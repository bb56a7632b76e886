"""Write a Llama-shaped GGUF file of random valid GGUF blocks (for memory and speed runs; not data).

  python tools/make_random_gguf.py OUT.gguf --shape llama3-8b --layout Q4_K_M
  python tools/make_random_gguf.py OUT.gguf --shape llama3-1b --layout Q8_0

Shapes: ``llama3-8b`` (Llama-3.1-8B: 32 layers, hidden 4096, 32/8 heads of 128, FFN 14336,
vocab 128256, untied output), ``llama3-1b`` (Llama-3.2-1B: 16 layers, hidden 2048, 32/8 heads
of 64, FFN 8192, tied), ``smollm2-135m`` (the embedded model's shapes: 30 layers, hidden 576,
9/3 heads of 64, FFN 1536, vocab 49152, tied, 8K context; for timing where the file cannot
travel), ``tiny`` (2 layers, hidden 256, 4/2 heads of 64, FFN 512, vocab 320,
untied; for tests), ``gemma3-1b`` (Gemma-3-1B, architecture ``gemma3``: 26 layers, hidden 1152,
4/1 heads of 256, FFN 6912, vocab 262144, tied, window 512 on 5 layers in 6), ``gemma3-tiny``
(6 layers of hidden 256, window 16; for tests) and ``gemma2-2b`` (Gemma-2-2B, architecture
``gemma2``: 26 layers, hidden 2304, 8/4 heads of 256, FFN 9216, vocab 256000, tied, 8K context,
window 4096 on every other layer, attention and output logits soft-capped at 50 and 30).
Layouts: ``Q4_K_M`` as llama.cpp's quantizer lays it out (Q4_K everywhere, Q6_K for
``output.weight``, or ``token_embd.weight`` where the output is tied to it (llama.cpp's
``llama_tensor_get_type`` quantizes the embedding as the output then), and for
``attn_v``/``ffn_down`` of the layers where
llama.cpp's ``use_more_bits`` holds: the first and last eighth of the layers and every third
one between, i.e. half of them; rows that are no whole number of 256-weight blocks fall back
to Q5_0, Q5_1 or Q8_0 for Q4_K, Q5_K or Q6_K, as llama.cpp's quantizer does), ``Q5_K_M`` (the
same with Q5_K), or one type for every matrix (``Q8_0``, ``Q4_0``, ``F16``, ... any of
:data:`magicpig_jax.io.gguf_blocks.QUANT_TYPES`).
Norms are F32 ones.

Blocks are random bytes with finite float16 scales drawn so that weights are of order 0.02
(the model computes garbage, but every value is finite and every kernel path is taken). The
tokenizer is byte-level BPE (pre-tokenizer ``llama-bpe``): the 256 byte tokens, filler tokens
up to the vocabulary, ``<|begin_of_text|>`` and ``<|eot_id|>``. Tensors are generated and
written one at a time (the writer holds one tensor, at most 0.5 GB for llama3-8b).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool
    context: int = 131072
    rope_theta: float = 500000.0
    arch: str = "llama"  # or "gemma3": q/k norms, sandwich norms, a sliding window on 5 layers in 6;
    # or "gemma2": sandwich norms, a sliding window on every other layer, logit soft-capping
    window: int = 0  # gemma2's and gemma3's attention.sliding_window


SHAPES = {
    "llama3-8b": Shape(32, 4096, 32, 8, 128, 14336, 128256, tied=False),
    "llama3-1b": Shape(16, 2048, 32, 8, 64, 8192, 128256, tied=True),
    "smollm2-135m": Shape(30, 576, 9, 3, 64, 1536, 49152, tied=True, context=8192, rope_theta=100000.0),
    "tiny": Shape(2, 256, 4, 2, 64, 512, 320, tied=False, context=4096, rope_theta=10000.0),
    "gemma3-1b": Shape(26, 1152, 4, 1, 256, 6912, 262144, tied=True, context=32768, rope_theta=1e6, arch="gemma3",
                       window=512),
    "gemma3-tiny": Shape(6, 256, 4, 1, 64, 512, 320, tied=True, context=4096, rope_theta=1e6, arch="gemma3",
                         window=16),
    "gemma2-2b": Shape(26, 2304, 8, 4, 256, 9216, 256000, tied=True, context=8192, rope_theta=10000.0,
                       arch="gemma2", window=4096),
}

# byte offsets of the float16 scales in each type's block, and their magnitude for weights ~ 0.02
_F16_AT = {"Q4_0": {0: 0.005}, "Q4_1": {0: 0.003, 2: -0.02}, "Q5_0": {0: 0.002}, "Q5_1": {0: 0.0015, 2: -0.02},
           "Q8_0": {0: 0.0002}, "Q4_K": {0: 1e-4, 2: 6e-4}, "Q5_K": {0: 5e-5, 2: 6e-4},
           "Q6_K": {208: 1.5e-5}}  # Q6_K: d × int8 scale (RMS ~74) × (q − 32) (RMS ~18)


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits in the *_K_M layouts."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# llama.cpp's quantizer falls back to these for rows that are no whole number of 256-weight K blocks
_K_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def tensor_type(name: str, layer: int | None, shape: Shape, layout: str, cols: int | None = None) -> str:
    """The GGUF type of a matrix with ``cols`` weights per row under ``layout``."""
    kind = layout
    if layout in ("Q4_K_M", "Q5_K_M"):
        kind = layout[:4]
        if name == "output.weight" or (name == "token_embd.weight" and shape.tied):  # the tied output
            kind = "Q6_K"
        elif name in ("attn_v.weight", "ffn_down.weight") and use_more_bits(layer, shape.layers):
            kind = "Q6_K"
    if cols is not None and cols % 256 and kind in _K_FALLBACK:
        kind = _K_FALLBACK[kind]
    return kind


def random_tensor(rng: np.random.Generator, qtype: str, rows: int, cols: int) -> np.ndarray:
    """Random valid rows ``[rows, RB]`` uint8 (F16/BF16: normal weights of scale 0.02)."""
    from magicpig_jax.io.gguf_blocks import QUANT_TYPES

    _, bb, bw = QUANT_TYPES[qtype]
    if qtype in ("F16", "BF16"):
        w = (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(np.float32)
        if qtype == "F16":
            return w.astype(np.float16).view(np.uint8)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    nb = cols // bw
    out = rng.integers(0, 256, (rows, nb, bb), dtype=np.uint8)
    for at, scale in _F16_AT[qtype].items():
        s = (np.abs(rng.standard_normal((rows, nb), np.float32)) * 0.5 + 0.75) * scale
        out[:, :, at:at + 2] = s.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return out.reshape(rows, nb * bb)


def tensor_plan(shape: Shape, layout: str) -> list[tuple[str, str, int, int]]:
    """``(gguf name, type, rows, cols)`` of every tensor (cols 0: a 1-D F32 norm of ``rows``)."""
    s = shape
    plan = [("token_embd.weight", tensor_type("token_embd.weight", None, s, layout, s.hidden), s.vocab, s.hidden)]
    for i in range(s.layers):
        def t(name, rows, cols, i=i):
            return (f"blk.{i}.{name}", tensor_type(name, i, s, layout, cols), rows, cols)
        plan += [(f"blk.{i}.attn_norm.weight", "F32", s.hidden, 0),
                 t("attn_q.weight", s.heads * s.head_dim, s.hidden),
                 t("attn_k.weight", s.kv_heads * s.head_dim, s.hidden),
                 t("attn_v.weight", s.kv_heads * s.head_dim, s.hidden),
                 t("attn_output.weight", s.hidden, s.heads * s.head_dim),
                 (f"blk.{i}.ffn_norm.weight", "F32", s.hidden, 0),
                 t("ffn_gate.weight", s.ffn, s.hidden),
                 t("ffn_up.weight", s.ffn, s.hidden),
                 t("ffn_down.weight", s.hidden, s.ffn)]
        if s.arch == "gemma3":
            plan += [(f"blk.{i}.{name}", "F32", n, 0) for name, n in (
                ("attn_q_norm.weight", s.head_dim), ("attn_k_norm.weight", s.head_dim),
                ("post_attention_norm.weight", s.hidden), ("post_ffw_norm.weight", s.hidden))]
        if s.arch == "gemma2":
            plan += [(f"blk.{i}.{name}", "F32", s.hidden, 0) for name in ("post_attention_norm.weight",
                                                                          "post_ffw_norm.weight")]
    plan.append(("output_norm.weight", "F32", s.hidden, 0))
    if not s.tied:
        plan.append(("output.weight", tensor_type("output.weight", None, s, layout, s.hidden), s.vocab, s.hidden))
    return plan


def _tokenizer(writer, vocab: int) -> None:
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    fill = vocab - len(alphabet) - 3
    tokens = alphabet + ["Ġt"] + [f"w{i:06d}" for i in range(fill)] + ["<|begin_of_text|>", "<|eot_id|>"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_merges(["Ġ t"])
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    writer.add_add_bos_token(True)


def write_random_gguf(path: str | Path, shape: Shape | str = "tiny", layout: str = "Q4_K_M", seed: int = 0,
                      log=None) -> Path:
    """Write the file; returns its path. ``log`` (e.g. ``print``) reports progress."""
    import gguf

    shape = SHAPES[shape] if isinstance(shape, str) else shape
    path = Path(path)
    rng = np.random.default_rng(seed)
    s = shape
    w = gguf.GGUFWriter(str(path), s.arch)
    if s.arch in ("gemma2", "gemma3"):
        w.add_sliding_window(s.window)
    if s.arch == "gemma2":  # Gemma 2's values, as its converter writes them
        w.add_float32("gemma2.attn_logit_softcapping", 50.0)
        w.add_float32("gemma2.final_logit_softcapping", 30.0)
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(s.vocab)
    _tokenizer(w, s.vocab)
    plan = tensor_plan(s, layout)
    from magicpig_jax.io.gguf_blocks import packed_row_bytes

    for name, qtype, rows, cols in plan:
        if cols == 0:
            w.add_tensor_info(name, (rows,), np.dtype(np.float32), rows * 4)
        else:
            rb = packed_row_bytes(qtype, cols)
            w.add_tensor_info(name, (rows, rb), np.dtype(np.uint8), rows * rb,
                              raw_dtype=gguf.GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    start = time.perf_counter()
    for k, (_name, qtype, rows, cols) in enumerate(plan):
        if cols == 0:
            w.write_tensor_data(np.ones(rows, np.float32))
        else:
            w.write_tensor_data(random_tensor(rng, qtype, rows, cols))
        if log is not None and (k % 20 == 0 or k == len(plan) - 1):
            log(f"{k + 1}/{len(plan)} tensors, {time.perf_counter() - start:.0f} s")
    w.close()
    return path


def _single_types() -> list[str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from magicpig_jax.io.gguf_blocks import QUANT_TYPES

    return sorted(QUANT_TYPES)


def _layout(value: str) -> str:
    if value not in ("Q4_K_M", "Q5_K_M", *_single_types()):
        raise argparse.ArgumentTypeError(f"must be Q4_K_M, Q5_K_M or one of {', '.join(_single_types())}, "
                                         f"got {value!r}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="the GGUF file to write")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b",
                   help="the model's shape (default llama3-8b: a file of about 4.9 GB; 'tiny' writes under 1 MB)")
    p.add_argument("--layout", default="Q4_K_M", type=_layout,
                   help="Q4_K_M, Q5_K_M, or one type for every matrix: " + ", ".join(_single_types())
                   + " (default Q4_K_M)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random blocks (default 0)")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    write_random_gguf(args.out, args.shape, args.layout, args.seed, log=print)
    print(f"wrote {args.out} ({args.out.stat().st_size / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
