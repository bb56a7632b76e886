"""End-to-end decode speed of the embedded SmolLM2: dense vs MagicPIG (host op), per prompt length.

For every prompt length the prompt (real prose: the GPL-3 text, repeated as needed)
is prefilled once (dense, chunked); then each method decodes ``--steps`` tokens
greedily from that prefill, and the time per token after the first (compiling)
step is reported with the sampled fraction. Lengths past the model's trained
context (8K) are allowed with ``--allow-beyond-context`` (timing only).

With ``--peer llama.cpp`` the same GGUF file decodes the same prompt ids in llama.cpp
(``llama-cpp-python``, the optional ``peer`` extra) in the same run, timed the same way
(see :mod:`magicpig_jax.eval.peer`).

Usage: ``magicpig-jax bench decode --lengths 1024 4096 8192 --peer llama.cpp --out runs/bench_decode``
writes ``runs/bench_decode.json`` and ``.png``. Not a test: run it by hand.
Source of the method: arXiv 2410.16179 (Section 5.3 measures the same quantity).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from magicpig_jax.eval.peer import PEERS, llama_cpp_available, llama_cpp_decode

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")


def _prompt_ids(model, text: str, n: int) -> list[int]:
    ids = model.tokenizer.encode(text)
    if not ids:
        raise ValueError("the prompt text is empty")
    reps = -(-n // len(ids))
    return (ids * reps)[:n]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0. See the module docstring."""
    from tqdm import tqdm

    from magicpig_jax.attention import MagicPIGConfig
    from magicpig_jax.generation import decode, kv_cache_dtype, prefill
    from magicpig_jax.io.loader import load_model

    p = argparse.ArgumentParser(prog="magicpig-jax bench decode", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--methods", nargs="+", default=["dense", "magicpig"],
                   help="decode backends (dense, magicpig, magicpig-ref)")
    p.add_argument("--steps", type=int, default=32, help="tokens decoded per method")
    p.add_argument("--K", type=int, default=10)
    p.add_argument("--L", type=int, default=150)
    p.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="storage of our KV cache (llama.cpp keeps its own at its default, float16)")
    p.add_argument("--allow-beyond-context", action="store_true",
                   help="permit prompts longer than the trained context (timing only)")
    p.add_argument("--peer", choices=PEERS, action="append", default=[],
                   help="also time a peer implementation on the same GGUF and prompt ids (llama.cpp)")
    p.add_argument("--out", default="runs/bench_decode", help="output prefix (.json and .png)")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step compiles and is not timed)")
    if "llama.cpp" in args.peer and not llama_cpp_available():
        p.error("--peer llama.cpp needs llama-cpp-python: pip install -e '.[peer]' (compiles llama.cpp)")
    model = load_model(args.model)
    if args.peer and Path(model.source).suffix != ".gguf":
        p.error(f"--peer needs a .gguf --model (llama.cpp reads GGUF only), got {model.source}")
    text = args.text.read_text(encoding="utf-8")
    cfg = MagicPIGConfig(K=args.K, L=args.L)
    results = []
    jobs = [(n, m) for n in args.lengths for m in [*args.methods, *args.peer]]
    bar = tqdm(total=len(jobs), desc="bench decode")
    for n in args.lengths:
        ids = _prompt_ids(model, text, n)
        if "llama.cpp" in args.peer:
            r = llama_cpp_decode(model.source, ids, args.steps + 1)
            results.append({
                "prompt_tokens": n, "method": "llama.cpp", "prefill_seconds": r["prefill_seconds"],
                "ms_per_token": r["ms_per_token"], "tokens_per_s": r["tokens_per_s"], "sampled_fraction": None,
                "compile_seconds": None, "peer_version": r["version"], "threads": r["threads"], "tokens": r["tokens"],
            })
            bar.update(1)
        state = prefill(model, [ids], args.steps, allow_beyond_context=args.allow_beyond_context,
                        cache_dtype=kv_cache_dtype(args.kv_dtype))
        for method in args.methods:
            outs, stats = decode(model, state, attention=method, max_new_tokens=args.steps + 1, config=cfg,
                                 stop_on_eos=False)
            results.append({
                "prompt_tokens": n, "method": method, "prefill_seconds": state.seconds,
                "ms_per_token": 1000.0 / stats["decode_tokens_per_s"],
                "tokens_per_s": stats["decode_tokens_per_s"], "sampled_fraction": stats["sampled_fraction"],
                "compile_seconds": stats["compile_seconds"], "tokens": outs[0],
            })
            bar.update(1)
    bar.close()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    meta = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "time": time.strftime("%Y-%m-%d %H:%M"),
            "K": args.K, "L": args.L, "steps": args.steps, "kv_dtype": args.kv_dtype,
            "note": "ms_per_token: mean over steps after the first; tokens_equal_to_dense: greedy tokens "
                    "equal position by position to our dense decode of the same prompt"}
    print(f"{'prompt':>7} {'method':>13} {'ms/token':>9} {'tok/s':>7} {'sampled':>8} {'same tokens as dense':>21}")
    for r in results:
        frac = "-" if r["sampled_fraction"] is None else f"{100 * r['sampled_fraction']:.2f}%"
        dense = next((d["tokens"] for d in results
                      if d["method"] == "dense" and d["prompt_tokens"] == r["prompt_tokens"]), None)
        r["tokens_equal_to_dense"] = (None if dense is None else
                                      sum(a == b for a, b in zip(dense, r["tokens"], strict=False)))
        same = "-" if dense is None else f"{r['tokens_equal_to_dense']}/{min(len(dense), len(r['tokens']))}"
        print(f"{r['prompt_tokens']:>7} {r['method']:>13} {r['ms_per_token']:>9.1f} {r['tokens_per_s']:>7.2f} "
              f"{frac:>8} {same:>21}")
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2)
    _plot(results, args.out + ".png")
    print(f"wrote {args.out}.json and {args.out}.png")
    return 0


def _plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    for method in dict.fromkeys(r["method"] for r in results):
        rs = [r for r in results if r["method"] == method]
        ax.plot([r["prompt_tokens"] for r in rs], [r["ms_per_token"] for r in rs], "o-", label=method)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms per decoded token")
    ax.set_xscale("log", base=2)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
