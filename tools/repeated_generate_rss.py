"""Resident memory over repeated ``generate()`` calls on prompts of growing length (one process).

  python tools/repeated_generate_rss.py --calls 14 --step-words 150 --json runs/repeated_rss.json
  python tools/repeated_generate_rss.py ... --retained-shapes 1000000000   # every shape's programs kept

Each call decodes ``--max-new-tokens`` tokens of a prompt ``--step-words`` words longer than the
last, so the KV cache's capacity (a multiple of 256 tokens) grows every few calls and each new
capacity compiles its own prefill, decode step and index build. The JSON records ``VmRSS`` after
each call (``magicpig_jax.memory.current_rss_bytes``), the prompt's tokens and the wall time, with
``magicpig_jax.memory.RETAINED_SHAPES`` as set (``--retained-shapes``; the library's default
when not given).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--calls", type=int, default=14)
    p.add_argument("--step-words", type=int, default=150)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--attention", default="magicpig")
    p.add_argument("--retained-shapes", type=int, default=None)
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    if args.calls < 1 or args.step_words < 1:
        p.error("--calls and --step-words must be >= 1")

    from magicpig_jax import generate, load_model, memory
    from magicpig_jax.generation import encode_prompt

    if args.retained_shapes is not None:
        memory.RETAINED_SHAPES = args.retained_shapes
    model = load_model(args.model)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    rows = [{"call": -1, "prompt_tokens": 0, "rss_bytes": memory.current_rss_bytes(), "seconds": 0.0}]
    start = time.perf_counter()
    for i in range(args.calls):
        prompt = " ".join(words[j % len(words)] for j in range(40 + args.step_words * i))
        generate(model, prompt, attention=args.attention, max_new_tokens=args.max_new_tokens)
        rows.append({"call": i, "prompt_tokens": len(encode_prompt(model, prompt)),
                     "rss_bytes": memory.current_rss_bytes(), "seconds": time.perf_counter() - start})
        print(f"call {i}: {rows[-1]['prompt_tokens']} prompt tokens, RSS {rows[-1]['rss_bytes'] / 2**20:.0f} MiB, "
              f"{rows[-1]['seconds']:.1f} s", flush=True)
    from magicpig_jax.eval.store import machine_info

    out = {"retained_shapes": memory.RETAINED_SHAPES, "attention": args.attention, "calls": rows,
           "peak_rss_bytes": memory.peak_rss_bytes(), "model": str(model.source), "machine": machine_info()}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
