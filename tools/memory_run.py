"""RSS and time of each phase of a long-context run: load, prefill, then decode per method.

  python tools/memory_run.py --model /path/llama3-8b-q4km.gguf --length 8192 --steps 16 \
      --kv-dtype bfloat16 --methods magicpig dense --consume-cache --json runs/mem_8b.json

The prompt is ``--length`` token ids drawn at random from the vocabulary (the weights of a
random GGUF make any text meaningless; the cost does not depend on the ids). Each phase
prints the RSS now and the peak so far (``VmHWM``). With ``--consume-cache`` the last
method decodes from the prefill's cache itself instead of a copy of it (what a run that does
not reuse its prefill needs). Run under ``/usr/bin/time -v`` for the process's peak.

``--synthetic-prefill`` skips the prefill: the cache is filled with random keys and values of
the model's shapes (standard normal, in the cache dtype) and the first token's logits are
zero. For timing and memory at contexts whose real prefill would take hours on this machine
(issue 14: the 8B-shaped file at 32K); the tokens decoded from it mean nothing, and the
sampled fraction is that of random keys, not of a real model's attention.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def _status() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:")):
            out[line.split(":")[0]] = int(line.split()[1]) * 1024
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--length", type=int, default=8192)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="bfloat16")
    p.add_argument("--methods", nargs="+", default=["magicpig", "dense"])
    p.add_argument("--consume-cache", action="store_true")
    p.add_argument("--synthetic-prefill", action="store_true",
                   help="random K/V of the model's shapes instead of a prefill (timing and memory only)")
    p.add_argument("--float32-weights", action="store_true",
                   help="load_model(packed_weights=False): every matrix as a float32 copy")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import jax.numpy as jnp
    import numpy as np

    from magicpig_jax.generation import decode, prefill
    from magicpig_jax.io.loader import load_model
    from magicpig_jax.models.cache import KVCache

    phases = []

    def mark(name, seconds, **extra):
        s = _status()
        phases.append({"phase": name, "seconds": seconds, "rss_bytes": s["VmRSS"], "peak_bytes": s["VmHWM"],
                       "anon_bytes": s.get("RssAnon"), "file_bytes": s.get("RssFile"), **extra})
        print(f"{name:<24} {seconds:8.1f} s  rss {s['VmRSS'] / 2**30:6.2f} GiB  peak {s['VmHWM'] / 2**30:6.2f} GiB "
              + " ".join(f"{k}={v}" for k, v in extra.items()), flush=True)

    mark("start", 0.0)
    t = time.perf_counter()
    model = load_model(args.model, packed_weights=not args.float32_weights)
    mark("load", time.perf_counter() - t)
    # ordinary ids, away from the special tokens at either end; a small vocabulary (a tiny test model) uses it whole
    V = model.config.vocab_size
    low, high = (300, V - 300) if V > 1200 else (0, V)
    ids = np.random.default_rng(0).integers(low, high, args.length).tolist()
    t = time.perf_counter()
    dtype = jnp.bfloat16 if args.kv_dtype == "bfloat16" else jnp.float32
    if args.synthetic_prefill:
        state = synthetic_prefill(model, args.length, args.steps + 1, dtype)
        mark("synthetic prefill", time.perf_counter() - t, tokens=args.length)
    else:
        state = prefill(model, [ids], args.steps + 1, cache_dtype=dtype)
        mark("prefill", time.perf_counter() - t, tokens=args.length)
    for i, method in enumerate(args.methods):
        last = i == len(args.methods) - 1
        original = KVCache.copy
        if args.consume_cache and last:
            KVCache.copy = lambda self: self  # decode from the prefill's own buffers
        try:
            t = time.perf_counter()
            outs, stats = decode(model, state, attention=method, max_new_tokens=args.steps, stop_on_eos=False)
        finally:
            KVCache.copy = original
        ms = 1e3 / stats["decode_tokens_per_s"] if stats.get("decode_tokens_per_s") else None
        mark(f"decode {method}", time.perf_counter() - t, ms_per_token=None if ms is None else round(ms, 1),
             compile_s=round(stats["compile_seconds"], 1), sampled_fraction=stats.get("sampled_fraction"))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "phases": phases}, indent=1))
    return 0


def synthetic_prefill(model, length: int, max_new_tokens: int, dtype):
    """A one-row PrefillState of ``length`` positions of random keys and values (see the docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from magicpig_jax.generation import CHUNK, PrefillState
    from magicpig_jax.models.cache import KVCache

    cfg = model.config
    capacity = -(-(length + max_new_tokens + 1) // CHUNK) * CHUNK
    shape = (1, cfg.num_kv_heads, capacity, cfg.head_dim)
    fill = jax.jit(lambda key: jax.random.normal(key, shape, jnp.float32).astype(dtype))
    base = jax.random.key(0)
    k = tuple(fill(jax.random.fold_in(base, 2 * i)) for i in range(cfg.num_layers))
    v = tuple(fill(jax.random.fold_in(base, 2 * i + 1)) for i in range(cfg.num_layers))
    cache = KVCache(k=k, v=v, lengths=jnp.asarray([length], jnp.int32))
    jax.block_until_ready(cache)
    logits = jnp.zeros((1, cfg.vocab_size), jnp.float32)
    return PrefillState(cache, logits, np.asarray([length], np.int32), 0.0)


if __name__ == "__main__":
    raise SystemExit(main())
