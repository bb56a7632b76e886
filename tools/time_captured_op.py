"""Time the host attention ops over every layer of a real model's captured decode step.

  python -m magicpig_jax.eval.capture runs/cap8k.npz --text FILE --max-tokens 8192
  python tools/time_captured_op.py runs/cap8k.npz --configs 10x150 10x300 dense topk:288 --reps 40 \
      --json runs/op.json

Each config is ``KxL`` (MagicPIG's op, ``host_sampled_attention``, sinks and tail inside the op,
no JAX static part), ``dense`` (the exact op, ``host_exact_attention``, every key) or
``topk:BUDGET`` (the TopK op, ``host_topk_attention``, BUDGET keys per query head over the whole
context). For MagicPIG the host index of every layer is built from the captured keys (bfloat16,
as the decoder stores them) and the query codes are computed once. One timed repetition calls
the op for every layer in turn: the layers' K, V and index together are far larger than the
last-level cache, so each call finds its layer's data in memory, as a decode step does. The
buffers are backed by huge pages where the kernel allows (``advise_huge_pages``), as the decoder's
are, so that both read the same kind of pages (on the 2-core VM the 8K step timed the same either
way, within the drift).
Reports the median, min and max over ``--reps`` repetitions of the summed per-step time, and
the mean fraction of keys sampled (MagicPIG) or kept (TopK).

To compare two builds of the op in one run (this machine's speed drifts between runs), copy
each build's ``_host_ops`` module aside and alternate them, one process per build and round;
docs/benchmarks.md ("Splitting heads") gives the figures and the rounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("capture", type=Path, help="npz of magicpig_jax.eval.capture (q, k, v of every layer)")
    p.add_argument("--configs", nargs="+", default=["10x150", "10x300"],
                   help="KxL (MagicPIG), dense, or topk:BUDGET")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--batch", type=int, default=1,
                   help="B rows, each a copy of the captured step (a batch decoding one prompt, as bench decode)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    if a.reps < 3:
        p.error("--reps must be at least 3 (a figure is a median of repeats)")
    if a.batch < 1:
        p.error(f"--batch must be at least 1, got {a.batch}")
    for text in a.configs:
        if _parse(text) is None:
            p.error(f"--configs: {text!r} is not KxL (e.g. 10x150), dense, or topk:BUDGET (e.g. topk:288)")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from magicpig_jax import lsh
    from magicpig_jax.attention import MagicPIGConfig
    from magicpig_jax.host import advise_huge_pages, host_build_index, host_exact_attention, host_sampled_attention
    from magicpig_jax.host.topk import host_topk_attention
    from magicpig_jax.models.backends import layer_projections

    d = np.load(a.capture)
    q_all, k_all, v_all = d["q"], d["k"], d["v"]
    layers, _, N, D = k_all.shape
    B = a.batch
    n = jnp.full((B,), N, jnp.int32)
    op = jax.jit(lambda q, qc, k, v, idx: host_sampled_attention(q, qc, k, v, idx, n, window=0, sinks=True))
    exact = jax.jit(lambda q, k, v: host_exact_attention(q, k, v, n))
    topk = jax.jit(lambda q, k, v, budget: host_topk_attention(q, k, v, budget, n), static_argnames="budget")

    def layer_kv(layer):
        return tuple(jnp.asarray(np.tile(x[layer][None], [B] + [1] * x[layer].ndim), dtype)
                     for x, dtype in ((q_all, jnp.float32), (k_all, jnp.bfloat16), (v_all, jnp.bfloat16)))

    results = []
    for text in a.configs:
        kind, arg = _parse(text)
        if kind == "dense":
            call, items, fraction = exact, [layer_kv(layer) for layer in range(layers)], 1.0
        elif kind == "topk":
            call = functools.partial(topk, budget=arg)  # budget static: one compilation per budget
            items, fraction = [layer_kv(layer) for layer in range(layers)], min(arg, N) / N
        else:
            K, L = arg
            cfg = MagicPIGConfig(K=K, L=L)
            items = []
            for layer in range(layers):
                q, k, v = layer_kv(layer)
                idx = host_build_index(k, layer_projections(cfg, layer, D), cfg, n, capacity=N)
                items.append((q, lsh.simhash_codes(q, idx.projections, K, L), k, v, idx))
            call = op
            fraction = float(np.mean([np.asarray(op(*it)[2]).mean() for it in items])) / N
        huge = advise_huge_pages(items)  # as the decoder backs its cache and index
        for it in items:
            jax.block_until_ready(call(*it))
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            for it in items:
                jax.block_until_ready(call(*it))
            ts.append(1000.0 * (time.perf_counter() - t0))
        row = {"config": text, "batch": B, "layers": layers, "context": int(N), "keys_fraction": fraction,
               "ms_per_step": {"median": float(np.median(ts)), "min": min(ts), "max": max(ts)}, "reps": a.reps,
               "huge_page_bytes": int(huge)}
        results.append(row)
        print(f"{text}: {row['ms_per_step']['median']:.2f} ms per step (min {min(ts):.2f}, max {max(ts):.2f}) "
              f"over {layers} layers at B={B}, N={N}, keys {fraction:.2%}, huge pages {huge / 2**20:.0f} MiB")
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"capture": str(a.capture), "results": results}, indent=2))
    return 0


def _parse(text: str):
    """``("dense", None)``, ``("topk", budget)`` or ``("magicpig", (K, L))``; None when malformed."""
    if text == "dense":
        return "dense", None
    if text.startswith("topk:"):
        budget = text[5:]
        return ("topk", int(budget)) if budget.isdigit() and int(budget) > 0 else None
    parts = text.split("x")
    if len(parts) == 2 and all(x.isdigit() and int(x) > 0 for x in parts):
        return "magicpig", (int(parts[0]), int(parts[1]))
    return None


if __name__ == "__main__":
    raise SystemExit(main())
