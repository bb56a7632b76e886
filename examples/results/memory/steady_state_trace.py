"""RSS of each phase of one decode in a process with a random bfloat16 cache (SmolLM2, 8,175 positions).

  python examples/results/memory/steady_state_trace.py magicpig [real]

A thread reads VmRSS from /proc/self/status every 2 ms and keeps the maximum per phase (the
phase names are set by wrapping the index build of each layer and the step's compilation);
then the sizes of the index's buffers and the cache. ``real`` prefills 8,175 random token ids
instead of tools/memory_run.py's synthetic cache. Output: steady_state_magicpig_8k_s43.txt.
"""

from __future__ import annotations

import resource
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))

LABEL = ["start"]
PEAKS: dict[str, int] = {}


def _rss_mib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def _sample() -> None:
    while True:
        r, k = _rss_mib(), LABEL[0]
        PEAKS[k] = max(PEAKS.get(k, 0), r)
        time.sleep(0.002)


def _phase(name: str) -> None:
    time.sleep(0.01)
    LABEL[0] = name


def main() -> None:
    from magicpig_jax import decode_loop
    from magicpig_jax.generation import Sampling, decode_spec, prefill
    from magicpig_jax.io.loader import load_model
    from magicpig_jax.models import decoding

    threading.Thread(target=_sample, daemon=True).start()
    method, real = sys.argv[1], len(sys.argv) > 2 and sys.argv[2] == "real"
    _phase("load")
    model = load_model(None)
    _phase("prefill")
    n = 8175
    if real:
        ids = np.random.default_rng(0).integers(300, model.config.vocab_size - 300, n).tolist()
        state = prefill(model, [ids], 17, cache_dtype=jnp.bfloat16)
    else:
        from memory_run import synthetic_prefill

        state = synthetic_prefill(model, n, 17, jnp.bfloat16)
    build = decoding._build_layer

    def traced_build(*args, **kwargs):
        if isinstance(args[2], jax.core.Tracer):  # traced for the shapes (compile ahead)
            return build(*args, **kwargs)
        _phase(f"build L{int(args[2])}")
        out = build(*args, **kwargs)
        jax.block_until_ready(out)
        _phase("after build layer")
        return out

    decoding._build_layer = traced_build
    ahead = decode_loop._step_compiled_ahead

    def traced_ahead(*args, **kwargs):
        _phase("compile ahead")
        out = ahead(*args, **kwargs)
        _phase("after compile")
        return out

    decode_loop._step_compiled_ahead = traced_ahead
    _phase("decode start")
    spec = decode_spec(model, method, None, positions=state.cache.capacity)
    run = decode_loop.start_decode(model, state, spec, 16, Sampling(), consume_prefill=True, stop_on_eos=False)
    _phase("steps")
    for _ in run:
        pass
    _phase("end")
    time.sleep(0.05)
    for k, v in PEAKS.items():
        if not k.startswith("build L") or k in ("build L1", "build L2", "build L29"):
            print(f"{k:20s} {v} MiB")
    builds = [v for k, v in PEAKS.items() if k.startswith("build")]
    if builds:
        print("max build", max(builds))
    print("VmHWM", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024, "MiB")
    total: dict[str, int] = {}
    for st in run.indices:
        if st is None:
            continue
        for path, leaf in jax.tree_util.tree_leaves_with_path(st):
            if hasattr(leaf, "nbytes"):
                key = jax.tree_util.keystr(path) + str(leaf.shape[-2:]) + str(leaf.dtype)
                total[key] = total.get(key, 0) + leaf.nbytes
    for k, v in total.items():
        print(k, round(v / 2**20, 1), "MiB")
    print("cache", sum(x.nbytes for x in jax.tree.leaves(run.cache)) / 2**20)


if __name__ == "__main__":
    main()
