"""``perf record`` of the decode steps alone: B rows of one prompt, after the prefill and the index build.

  python tools/profile_decode_step.py --method magicpig --batch 16 --length 8159 --out runs/perf16.data
  perf report -i runs/perf16.data --no-children --sort dso,sym --stdio

The prompt is the first ``--length`` tokens of GPL-3 (``bench decode``'s text), prefilled once
into a bfloat16 cache and broadcast to ``--batch`` rows as ``bench decode`` does. One untimed
run compiles and warms; then a second run's index is built, its first two steps run, and
``perf`` is attached to this process for the remaining steps only (the prefill and the build
are not in the samples). The released extension is stripped: to see the host ops' functions,
build one with nanobind's ``NOSTRIP`` and name it in ``$MAGICPIG_HOST_OPS_LIB``
(docs/benchmarks.md says how the committed profiles were made). Needs ``perf`` on the PATH.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--method", default="magicpig", choices=["dense", "magicpig"])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=8159)
    p.add_argument("--steps", type=int, default=32,
                   help="decode steps of the profiled run (the prompt and the steps must fit the model's context: "
                        "8,159 + 32 + 1 = 8,192 on SmolLM2, as bench decode's 8K prompt)")
    p.add_argument("--frequency", type=int, default=1999, help="perf's samples per second")
    p.add_argument("--out", type=Path, default=Path("runs/perf_decode.data"))
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from magicpig_jax.decode_loop import Sampling, start_decode
    from magicpig_jax.eval.bench_decode import DEFAULT_TEXT, batched_state, prompt_ids
    from magicpig_jax.generation import decode_spec, prefill
    from magicpig_jax.io.loader import load_model

    model = load_model(None)
    ids = prompt_ids(model, DEFAULT_TEXT.read_text(encoding="utf-8"), args.length)
    state = prefill(model, [ids], args.steps + 2, cache_dtype=jnp.bfloat16)
    spec = decode_spec(model, args.method, None, positions=state.cache.capacity)

    def start():
        return start_decode(model, batched_state(state, args.batch), spec, args.steps + 1, Sampling(),
                            stop_on_eos=False)

    warm = start()
    for _ in warm:
        pass
    stats = warm.stats()
    print(f"warm-up run: {1e3 * stats['decode_seconds'] / (stats['decode_steps'] - 1):.1f} ms per step", flush=True)
    del warm
    run = start()
    steps = iter(run)
    next(steps), next(steps)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    perf = subprocess.Popen(["perf", "record", "-F", str(args.frequency), "-p", str(os.getpid()), "-o", str(args.out)],
                            stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf attaches
    if perf.poll() is not None:
        raise SystemExit(f"perf record exited with status {perf.returncode} (is perf allowed here? "
                         "/proc/sys/kernel/perf_event_paranoid)")
    t0 = time.perf_counter()
    n = sum(1 for _ in steps)
    seconds = time.perf_counter() - t0
    perf.send_signal(signal.SIGINT)
    perf.wait()
    print(f"profiled: {n} iterations in {seconds:.2f} s, {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
