"""Where the offload decoder's time goes on an accelerator (issue 13; docs/benchmarks.md, "On a GPU").

  python tools/offload_phases.py --out phases.json            # one layer's phases, three shapes
  python tools/offload_phases.py --out phases.json --decode M.gguf --profile decode_profile.txt

*Layer phases*: one layer's offloaded MagicPIG attention (:mod:`magicpig_jax.offload`) on a
synthetic cache, each phase timed alone with the device idle before and after it (median of
``--reps`` calls, ms): the accelerator part (query codes + static attention), the transfer of
``(q, codes)`` to the host device, the host op, the transfer of ``(out, lse)`` back, the merge,
the whole chain as the one-layer API runs it, and the fixed costs under them (an empty jitted call
on each device, a 4-byte transfer each way, the same bytes as one packed array).

*Decode profile* (``--decode``): the model prefilled at ``--context``, then MagicPIG's decode at
B = 1 under ``cProfile`` (the Python side of the offload step: dispatch, transfers, waits), top
functions by cumulative time written to ``--profile``.

*compute_on* (``--compute-on``, in a child process, since a refusal aborts the process): registers
the host op's FFI targets with the accelerator's plugin for its host platform too, and times the
layer's host part as a ``pinned_host`` + ``compute_on("device_host")`` computation.

With two CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=2``) it runs on a CPU-only
machine, cpu:0 standing in for the accelerator.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

SHAPES = {  # (B, Hq, Hkv, N, D)
    "smollm2-8k-b1": (1, 9, 3, 8192, 64),
    "smollm2-8k-b16": (16, 9, 3, 8192, 64),
    "llama3.1-8b-32k-b2": (2, 32, 8, 32768, 128),
    "tiny": (2, 4, 2, 512, 16),  # the suite's smoke run
}


def median_ms(fn, reps: int) -> float:
    """Median wall ms of ``fn()`` (blocked) over ``reps`` calls after two warm-up calls."""
    for _ in range(2):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def devices():
    cpus = jax.devices("cpu")
    accel = jax.devices()[0]
    host_dev = cpus[1] if accel.platform == "cpu" and len(cpus) > 1 else cpus[0]
    return accel, host_dev


def layer_phases(name: str, reps: int) -> dict:
    from accelerator_check import synthetic_layer

    from magicpig_jax import host, lsh, offload
    from magicpig_jax.attention import MagicPIGConfig

    accel, host_dev = devices()
    B, Hq, Hkv, N, D = SHAPES[name]
    cfg = MagicPIGConfig(K=10, L=150)
    q, k, v = synthetic_layer(np.random.default_rng(0), B, Hq, Hkv, N, D)
    lengths = np.full((B,), N, np.int32)
    proj = lsh.simhash_projections(jax.random.key(0), D, cfg.K, cfg.L)
    k_h, v_h, proj_h, len_h = jax.device_put((k, v, proj, lengths), host_dev)
    index = jax.jit(host.host_build_index, static_argnames=("config", "capacity"))(k_h, proj_h, cfg, len_h,
                                                                                     capacity=N)
    a_state, h_state = offload.prepare_offload(k_h, v_h, index, cfg, len_h, accel_device=accel, host_device=host_dev)
    q_a = jax.device_put(q, accel)
    codes, out_s, lse_s = jax.block_until_ready(offload.accelerator_part(q_a, a_state, K=cfg.K, L=cfg.L))
    q_h, codes_h = jax.block_until_ready(jax.device_put((q_a, codes), host_dev))
    out_h, lse_h, _ = jax.block_until_ready(offload.host_part(q_h, codes_h, h_state))
    out_a, lse_a = jax.block_until_ready(jax.device_put((out_h, lse_h), accel))
    nbytes_up = q_a.nbytes + codes.nbytes
    packed_a = jax.device_put(jnp.zeros((nbytes_up // 4,), jnp.float32), accel)
    packed_h = jax.device_put(jnp.zeros(((out_h.nbytes + lse_h.nbytes) // 4,), jnp.float32), host_dev)
    tiny_a, tiny_h = jax.device_put(jnp.zeros((1,), jnp.float32), accel), jax.device_put(
        jnp.zeros((1,), jnp.float32), host_dev)
    bump = jax.jit(lambda x: x + 1)
    r = {
        "shape": {"B": B, "Hq": Hq, "Hkv": Hkv, "N": N, "D": D, "K": cfg.K, "L": cfg.L},
        "accelerator_part": median_ms(lambda: offload.accelerator_part(q_a, a_state, K=cfg.K, L=cfg.L), reps),
        "to_host_q_codes": median_ms(lambda: jax.device_put((q_a, codes), host_dev), reps),
        "host_op": median_ms(lambda: offload.host_part(q_h, codes_h, h_state), reps),
        "to_accelerator_out_lse": median_ms(lambda: jax.device_put((out_h, lse_h), accel), reps),
        "merge": median_ms(lambda: offload.merge_part(out_a, lse_a, out_s, lse_s), reps),
        "whole_layer": median_ms(lambda: offload.offload_magicpig_attention(q_a, a_state, h_state, cfg)[:2], reps),
        "to_host_packed_same_bytes": median_ms(lambda: jax.device_put(packed_a, host_dev), reps),
        "to_accelerator_packed_same_bytes": median_ms(lambda: jax.device_put(packed_h, accel), reps),
        "to_host_4_bytes": median_ms(lambda: jax.device_put(tiny_a, host_dev), reps),
        "to_accelerator_4_bytes": median_ms(lambda: jax.device_put(tiny_h, accel), reps),
        "to_numpy_4_bytes": median_ms(lambda: np.asarray(bump(tiny_a)), reps),
        "empty_jit_accelerator": median_ms(lambda: bump(tiny_a), reps),
        "empty_jit_host": median_ms(lambda: bump(tiny_h), reps),
        "bytes_to_host": int(nbytes_up), "bytes_to_accelerator": int(out_h.nbytes + lse_h.nbytes),
    }
    print(name, json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}), flush=True)
    return r


def decode_profile(model_path: str, context: int, steps: int, profile_out: str) -> dict:
    import cProfile
    import dataclasses
    import io
    import pstats

    from magicpig_jax.attention import MagicPIGConfig
    from magicpig_jax.decode_loop import Sampling, start_decode
    from magicpig_jax.eval.bench_decode import prompt_ids
    from magicpig_jax.generation import decode_spec, prefill
    from magicpig_jax.io.loader import load_model

    accel, host_dev = devices()
    options = {"offload": True, "host_device": host_dev} if accel.platform == "cpu" else {}
    model = load_model(model_path)
    text = (ROOT / "magicpig_jax" / "data" / "lgpl-2.1.txt").read_text()
    ids = prompt_ids(model, text, min(context, model.config.max_position_embeddings - steps - 3))
    state = prefill(model, [ids], steps + 3)
    spec = dataclasses.replace(decode_spec(model, "magicpig", MagicPIGConfig(K=10, L=150)), **options)
    run = start_decode(model, state, spec, steps + 2, Sampling(), stop_on_eos=False, consume_prefill=True)
    it = iter(run)
    next(it)  # token 0, from the prefill's logits
    next(it)  # step 1 compiles the segments and the host layers (step 2 is enqueued with it)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    n = sum(1 for _ in it)
    prof.disable()
    wall = time.perf_counter() - t0
    s = io.StringIO()
    st = pstats.Stats(prof, stream=s)
    st.sort_stats("cumulative").print_stats(40)
    s.write("\n=== by own time ===\n")
    st.sort_stats("tottime").print_stats(30)
    s.write("\n=== callers of eager ops and transfers ===\n")
    st.print_callers("apply_primitive|batched_device_put|block_until_ready|_single_device_array_to_np")
    Path(profile_out).write_text(s.getvalue())
    stats = run.stats()
    out = {"context": len(ids), "profiled_yields": n, "profiled_wall_s": wall,
           "decode_steps": stats.get("decode_steps"), "runs_on": stats.get("attention_runs_on")}
    print("decode", json.dumps(out), flush=True)
    return out


COMPUTE_ON = r'''
import sys, time, statistics, json
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/examples")
import jax, numpy as np
from jax._src.lib import xla_client
from magicpig_jax.host import _ext
mod = _ext.ops()
plat = {"gpu": "CUDA", "cuda": "CUDA", "rocm": "ROCM"}.get(jax.devices()[0].platform)
handler = xla_client._custom_callback_handler.get(plat) if plat else None
print("plugin handler for", plat, ":", handler, flush=True)
for name, cap in mod.registrations().items():
    handler(name, cap, "Host", 1, xla_client.CustomCallTargetTraits.DEFAULT)
print("registered", len(mod.registrations()), "targets for platform Host", flush=True)
import accelerator_check
sys.exit(accelerator_check.main(["--mechanisms", "--steps", "20"] + sys.argv[2:]))
'''


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", nargs="+", default=[s for s in SHAPES if s != "tiny"], choices=list(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--decode", default=None, help="a GGUF model for the decode profile")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--profile", default="decode_profile.txt")
    ap.add_argument("--compute-on", action="store_true")
    args = ap.parse_args(argv)
    accel, host_dev = devices()
    res = {"jax": jax.__version__, "accelerator": str(accel), "host": str(host_dev), "layers": {}}
    print(f"jax {jax.__version__}; accelerator {accel}; host {host_dev}", flush=True)
    for name in args.shapes:
        res["layers"][name] = layer_phases(name, args.reps)
        Path(args.out).write_text(json.dumps(res, indent=1))
    if args.decode:
        res["decode"] = decode_profile(args.decode, args.context, args.steps, args.profile)
        Path(args.out).write_text(json.dumps(res, indent=1))
    if args.compute_on:
        # The child would not get GPU memory beside its parent's preallocation.
        env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
        p = subprocess.run([sys.executable, "-c", COMPUTE_ON, str(ROOT), "--context", "8192", "--q-heads", "9",
                            "--kv-heads", "3", "--head-dim", "64", "--batch", "1"],
                           capture_output=True, text=True, timeout=300, env=env)
        keep = [x for x in p.stdout.splitlines() + p.stderr.splitlines() if "stack_frame_id" not in x
                and not x.lstrip().startswith("@") and "Source Location" not in x and "external/xla" not in x]
        lines = keep if len(keep) <= 40 else keep[:20] + ["..."] + keep[-20:]
        res["compute_on"] = {"returncode": p.returncode, "output": lines}
        print("\n".join(lines), flush=True)
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
