"""Timings of the products with GGUF rows (outside the test suite; run on a quiet machine).

  python tools/bench_weights.py matvec  [--mb 128] [--reps 20] [--tokens 1]  per-type decode matvec GB/s vs a
                                      copy (and GFLOP/s: with --tokens 16, a batched step's product)
  python tools/bench_weights.py gemm    [--tokens 256] [--reps 3] [--tile-mb 8 32]  prefill product of
                                      8B-shaped matrices: tiled vs whole-matrix dequantization vs float32
  python tools/bench_weights.py prefill [--model M] [--tokens 2048] prefill of a model, tiled vs layer vs float32
                                                                   (each in its own process: time and peak RSS)

``--json PATH`` writes the results. Figures on a shared machine are only comparable within one run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def _times(fn, reps: int) -> list[float]:
    fn()  # compile / warm up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def _median_seconds(fn, reps: int) -> float:
    return float(np.median(_times(fn, reps)))


def _copy_gbps(nbytes: int, reps: int) -> dict:
    """Bandwidth of a plain copy of ``nbytes`` (NumPy, one thread; and XLA, the intra-op pool)."""
    import jax
    import jax.numpy as jnp

    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    t_np = _median_seconds(lambda: np.copyto(dst, src), reps)
    xs = jnp.asarray(src.view(np.float32))
    add = jax.jit(lambda a: a + 1.0)
    t_xla = _median_seconds(lambda: add(xs).block_until_ready(), reps)
    return {"numpy_copy_read_gbps": nbytes / t_np / 1e9, "xla_elementwise_read_gbps": nbytes / t_xla / 1e9}


def bench_matvec(args) -> dict:
    import jax
    import jax.numpy as jnp

    from magicpig_jax.eval.rss import OtherLoad
    from magicpig_jax.host import has_avx2
    from magicpig_jax.host.matvec import quant_matvec
    from magicpig_jax.io.gguf_blocks import QUANT_TYPES, packed_row_bytes
    from tests._gguf_rows import random_rows

    rng = np.random.default_rng(0)
    n_in = 4096
    out = {"copy": _copy_gbps(args.mb << 20, args.reps), "types": {}}
    impls = ["avx2", "scalar"] if has_avx2() else ["scalar"]
    for qtype in sorted(QUANT_TYPES):
        rb = packed_row_bytes(qtype, n_in)
        rows = max(8, (args.mb << 20) // rb)
        w = jnp.asarray(random_rows(rng, qtype, rows, n_in))
        x = jnp.asarray(rng.standard_normal((args.tokens, n_in)).astype(np.float32))
        res = {"rows": rows, "in": n_in, "bytes": rows * rb, "tokens": args.tokens}
        for impl in impls:
            f = jax.jit(lambda x, w, impl=impl, qtype=qtype: quant_matvec(x, w, qtype, impl=impl))
            with OtherLoad() as load:
                reps = args.reps if impl == "avx2" else args.scalar_reps
                ts = _times(lambda f=f, x=x, w=w: f(x, w).block_until_ready(), reps)
            t = float(np.median(ts))
            res[f"{impl}_ms"] = 1e3 * t
            res[f"{impl}_ms_min_max"] = [1e3 * min(ts), 1e3 * max(ts)]
            res[f"{impl}_gbps"] = rows * rb / t / 1e9
            res[f"{impl}_gbps_min_max"] = [rows * rb / max(ts) / 1e9, rows * rb / min(ts) / 1e9]
            res[f"{impl}_gflops"] = 2 * args.tokens * rows * n_in / t / 1e9
            res[f"{impl}_other_processes_cpu_fraction"] = load.fraction
        out["types"][qtype] = res
        print(qtype, {k: round(v, 2) if isinstance(v, float) else v for k, v in res.items()}, flush=True)
    out["copy_end"] = _copy_gbps(args.mb << 20, args.reps)
    out["note"] = ("medians over --reps calls (--scalar-reps for the scalar kernels; min/max: the spread); x "
                   "--tokens float32 token rows; --mb MiB of rows per type; the pool's "
                   "threads; copy: NumPy one thread / XLA elementwise, before and after the types")
    print("copy", out["copy"], "end", out["copy_end"])
    return out


def bench_gemm(args) -> dict:
    """x [T, In] @ W.T for Llama-3.1-8B's gate/up (Q4_K, 28672 x 4096) and down (Q6_K, 4096 x 14336)."""
    import jax
    import jax.numpy as jnp

    from magicpig_jax.models import linear
    from magicpig_jax.models.dequant import dequantize
    from tests._gguf_rows import random_rows

    rng = np.random.default_rng(0)
    out = {"tokens": args.tokens, "tile_mb": args.tile_mb, "shapes": {}}
    for name, qtype, n_out, n_in in (("gate_up", "Q4_K", 28672, 4096), ("down", "Q6_K", 4096, 14336)):
        w = jnp.asarray(random_rows(rng, qtype, n_out, n_in))
        x = jnp.asarray(rng.standard_normal((args.tokens, n_in)).astype(np.float32))
        res = {"qtype": qtype, "out": n_out, "in": n_in}
        variants = [(f"tiled_{mb}mb",
                     jax.jit(lambda x, w, qtype=qtype, mb=mb: linear._tiled_matmul(x, w, qtype, mb << 20)),
                     (x, w)) for mb in args.tile_mb]
        layer = jax.jit(lambda x, w, qtype=qtype: linear._layer_matmul(x, w, qtype))
        jaxdq = jax.jit(lambda x, w, qtype=qtype: linear._jax_dequant_matmul(x, w, qtype))
        wf = jax.jit(dequantize, static_argnums=1)(w, qtype)
        f32 = jax.jit(lambda x, wf: linear.dense_matmul(x, wf, transposed=False))
        variants += [("layer", layer, (x, w)), ("jax_dequant", jaxdq, (x, w)), ("float32_weights", f32, (x, wf))]
        for label, fn, argv in variants:
            t = _median_seconds(lambda fn=fn, argv=argv: fn(*argv).block_until_ready(), args.reps)
            temp = fn.lower(*argv).compile().memory_analysis().temp_size_in_bytes
            res[label] = {"seconds": t, "gflops": 2 * args.tokens * n_out * n_in / t / 1e9, "temp_bytes": temp}
        out["shapes"][name] = res
        print(name, json.dumps(res), flush=True)
        del wf
    return out


_PREFILL_CHILD = r"""
import json, sys, time
import numpy as np
from magicpig_jax.eval.rss import PeakRSS
from magicpig_jax.io.loader import load_model
from magicpig_jax.models import linear
from magicpig_jax.generation import prefill
mode, model_path, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode != "float32":
    linear.PREFILL_MODE = mode
model = load_model(None if model_path == "-" else model_path, packed_weights=mode != "float32")
rss = PeakRSS()
ids = np.random.default_rng(0).integers(10, model.config.vocab_size - 10, tokens).tolist()
prefill(model, [ids[:256]], 1)  # compile the chunk function
rss.reset()
t = time.perf_counter()
state = prefill(model, [ids], 1)
seconds = time.perf_counter() - t
print(json.dumps({"mode": mode, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                  "peak_rss_bytes_during_prefill": rss.peak_bytes()}))
"""


def bench_prefill(args) -> dict:
    out = {"model": args.model or "embedded", "tokens": args.tokens, "runs": []}
    model = str(Path(args.model).resolve()) if args.model else "-"  # the child runs in the repository root
    for mode in ("tiled", "layer", "float32"):
        r = subprocess.run([sys.executable, "-c", _PREFILL_CHILD, mode, model, str(args.tokens)],
                           capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-3000:])
        res = json.loads(r.stdout.strip().splitlines()[-1])
        out["runs"].append(res)
        print(json.dumps(res), flush=True)
    return out


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("matvec")
    m.add_argument("--mb", type=_positive, default=128, help="MiB of rows per type (more than the caches)")
    m.add_argument("--reps", type=_positive, default=20, help="timed calls of the AVX2 kernels (default 20)")
    m.add_argument("--scalar-reps", type=_positive, default=3,
                   help="timed calls of the scalar kernels (default 3: they are several times slower)")
    m.add_argument("--tokens", type=_positive, default=1, help="token rows of x (a batched decode step: the batch)")
    g = sub.add_parser("gemm")
    g.add_argument("--tokens", type=_positive, default=256, help="token rows (the prefill chunk)")
    g.add_argument("--reps", type=_positive, default=3)
    g.add_argument("--tile-mb", type=_positive, nargs="+", default=[8, 32],
                   help="float32 MiB per tile of the tiled mode")
    f = sub.add_parser("prefill")
    f.add_argument("--model", default=None, help="GGUF file (default: the embedded SmolLM2)")
    f.add_argument("--tokens", type=_positive, default=2048)
    for s in (m, g, f):
        s.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests._gguf_rows
    result = {"matvec": bench_matvec, "gemm": bench_gemm, "prefill": bench_prefill}[args.cmd](args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
