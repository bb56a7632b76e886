"""Write a Llama-shaped Hugging Face directory of random bfloat16 weights (for memory and speed runs; not data).

  python tools/make_random_hf.py OUT_DIR                      # Llama-3.2-1B's shapes, untied output
  python tools/make_random_hf.py OUT_DIR --dtype float16

Shapes: 16 layers, hidden 2048, 32/8 heads of 64, FFN 8192, vocab 32000 (Llama-3.2-1B's but
for the vocabulary and an untied output: 1.1B weights, 2.2 GB). Matrices are normal with
standard deviation 0.02, norms ones; ``config.json`` is a ``llama`` one, and the tokenizer is
the test fixture's Llama-3-style one (``tests/fixtures/families/llama3``). Tensors are drawn
one at a time with ``jax.random`` and saved with ``safetensors``.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "families" / "llama3"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from safetensors.flax import save_file

    H, n_layers, n_heads, n_kv, ffn, vocab, D = 2048, 16, 32, 8, 8192, 32000, 64
    dtype = jnp.dtype(args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "llama", "vocab_size": vocab, "hidden_size": H, "intermediate_size": ffn,
              "num_hidden_layers": n_layers, "num_attention_heads": n_heads, "num_key_value_heads": n_kv,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False, "torch_dtype": args.dtype}
    (args.out / "config.json").write_text(json.dumps(config, indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURE / name, args.out / name)
    keys = iter(jax.random.split(jax.random.key(0), 4 + 7 * n_layers))

    def normal(shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) * 0.02).astype(dtype)

    weights = {"model.embed_tokens.weight": normal((vocab, H)), "lm_head.weight": normal((vocab, H)),
               "model.norm.weight": jnp.ones((H,), dtype)}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": jnp.ones((H,), dtype),
            p + "post_attention_layernorm.weight": jnp.ones((H,), dtype),
            p + "self_attn.q_proj.weight": normal((n_heads * D, H)),
            p + "self_attn.k_proj.weight": normal((n_kv * D, H)),
            p + "self_attn.v_proj.weight": normal((n_kv * D, H)),
            p + "self_attn.o_proj.weight": normal((H, n_heads * D)),
            p + "mlp.gate_proj.weight": normal((ffn, H)),
            p + "mlp.up_proj.weight": normal((ffn, H)),
            p + "mlp.down_proj.weight": normal((H, ffn)),
        })
    save_file(weights, str(args.out / "model.safetensors"))
    print(f"{args.out}: {sum(w.size for w in weights.values()) / 1e9:.2f}B weights in {args.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
