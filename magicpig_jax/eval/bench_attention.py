"""Benchmark one decode step of one layer: host MagicPIG op vs XLA dense vs the pure-JAX reference.

Synthetic keys: a sink token with a large norm, the rest in a cone around a mean
direction (as the paper observes for real keys, arXiv 2410.16179, Section 4.2), values
Gaussian; bfloat16 KV storage; K=10, L=150, 4 sinks, 64 local tokens by default.

Reported per (shape, N): time of ``host_magicpig_attention`` (sampled part on the host
+ static part in JAX + merge), of the FFI op alone, of jitted ``dense_attention`` and of
the jitted pure-JAX ``magicpig_attention`` (skipped above ``--ref-max-n``, noted in the
JSON); the sampled fraction; bytes touched by the op (sampled K and V rows + the bucket
lists walked) / op time against a memcpy bandwidth measured in the same run (once at its
start, and paired: each cold call against the copy that evicts the cache just before it);
index bytes per token per KV head against KV bytes per token per KV head.

Usage: ``python -m magicpig_jax.eval.bench_attention --n 8192 32768 --out runs/bench``
(or ``magicpig-jax bench attention ...``).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from magicpig_jax.argparsing import Parser, check_output
from magicpig_jax.eval.rss import OtherLoad, software_versions

SHAPES = {"llama3.1-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}


class _CopyEvict:
    """Copies a buffer of 256 MiB (at least 4x the last-level cache) between timed calls, so each call
    starts as a decode step does: the layer's K/V rows and buckets in DRAM, not left in L3 by the
    previous call with the same query. Each copy is timed (``last_bytes_per_s``): the op's bandwidth
    is then compared with a copy measured moments before it, under the same load, rather than with
    one copy at the start of the run (this machine's copy bandwidth drifts by tens of percent between
    minutes)."""

    def __init__(self):
        n = _evict_bytes() // 8
        self.src = np.ones(n, np.float64)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)  # fault the pages in
        self.last_bytes_per_s = float("nan")

    def __call__(self) -> None:
        t = time.perf_counter()
        np.copyto(self.dst, self.src)
        self.last_bytes_per_s = self.src.nbytes / (time.perf_counter() - t)


def _evict_bytes() -> int:
    """Bytes each cold call's copy moves: at least 256 MiB and 4x the largest CPU cache."""
    return max(256 << 20, 4 * _llc_bytes())


def _llc_bytes() -> int:
    """The largest CPU cache (sysfs), 32 MiB when unknown."""
    best = 0
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            txt = size.read_text().strip()
            best = max(best, int(txt[:-1]) * (1024 if txt.endswith("K") else 1 << 20 if txt.endswith("M") else 1))
        except (OSError, ValueError):
            pass
    return best or (32 << 20)


def _timed_pair(fns: dict, reps: int, evict) -> dict:
    """Times each of ``fns`` ``reps`` times, interleaved (so drift of the machine hits all alike),
    each call after ``evict()`` if given. Returns ``{name: [seconds, ...]}``, with the process's CPU
    seconds under ``name + "_cpu"`` and, when ``evict`` is a :class:`_CopyEvict`, the bandwidth of the
    copy just before each call under ``name + "_copy"`` (bytes/s)."""
    for fn in fns.values():
        jax.block_until_ready(fn())  # compile
    ts = {name: [] for name in fns} | {name + "_cpu": [] for name in fns} | {name + "_copy": [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            if evict is not None:
                evict()
            c, t = time.process_time(), time.perf_counter()
            jax.block_until_ready(fn())
            ts[name].append(time.perf_counter() - t)
            ts[name + "_cpu"].append(time.process_time() - c)  # every thread of the process
            if isinstance(evict, _CopyEvict):
                ts[name + "_copy"].append(evict.last_bytes_per_s)
    return ts


def _spread(xs) -> dict:
    xs = np.asarray(xs, np.float64)
    return {"median": float(np.median(xs)), "min": float(xs.min()), "max": float(xs.max())}


def _spread_ms(xs) -> dict:
    return _spread(1e3 * np.asarray(xs))


def huge_page_coverage(*trees) -> tuple[int, int]:
    """``(bytes in AnonHugePages, bytes)`` of the CPU buffers of ``trees``, from ``/proc/self/smaps``
    (the huge pages of every mapping a buffer overlaps, capped at the overlap; (0, bytes) where
    smaps is unavailable)."""
    spans = []
    for leaf in jax.tree.leaves(trees):
        if isinstance(leaf, jax.Array) and leaf.nbytes:
            spans.append((leaf.unsafe_buffer_pointer(), leaf.nbytes))
    total = sum(n for _, n in spans)
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0, total
    huge, cur = 0, 0
    for line in lines:
        head = line.split(None, 1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            cur = sum(max(0, min(hi, p + n) - max(lo, p)) for p, n in spans)
        elif head == "AnonHugePages:" and cur:
            huge += min(cur, int(line.split()[1]) * 1024)
    return huge, total


def _copy_bandwidth(nbytes: int = 256 << 20, reps: int = 5) -> float:
    a = np.ones(nbytes // 8, np.float64)
    b = np.empty_like(a)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        np.copyto(b, a)
        ts.append(time.perf_counter() - t)
    return nbytes / min(ts)


def _synthetic(rng, Hq, Hkv, N, D):
    direction = rng.standard_normal(D).astype(np.float32)
    direction /= np.linalg.norm(direction)
    k = np.empty((1, Hkv, N, D), np.float32)
    step = 1 << 15
    for s in range(0, N, step):
        e = min(N, s + step)
        k[0, :, s:e] = 0.6 * rng.standard_normal((Hkv, e - s, D), np.float32) + 3.0 * direction
    k[0, :, 0] = 12.0 * direction  # sink
    v = rng.standard_normal((1, Hkv, N, D), np.float32)
    q = (rng.standard_normal((1, Hq, D)) - 1.5 * direction).astype(np.float32)
    return (
        jnp.asarray(q),
        jnp.asarray(k).astype(jnp.bfloat16),
        jnp.asarray(v).astype(jnp.bfloat16),
    )


def _bucket_bytes(index, q_codes) -> int:
    """Bytes of bucket ids the lookup walks (each uint16 id is read once)."""
    offsets = np.asarray(index.offsets)  # [B, Hkv, NC, L, NB]
    qc = np.asarray(q_codes)  # [B, Hq, L]
    B, Hq, L = qc.shape
    Hkv = offsets.shape[1]
    G = Hq // Hkv
    total = 0
    for b in range(B):
        for h in range(Hq):
            off = offsets[b, h // G]  # [NC, L, NB]
            c = qc[b, h][None, :, None].astype(np.int64)
            lo = np.take_along_axis(off, c, axis=2)
            hi = np.take_along_axis(off, c + 1, axis=2)
            total += int((hi - lo).sum())
    return 2 * total


def _bytes_needed(shape_name: str, N: int, L: int) -> int:
    """A lower bound on the bytes one case holds at once: float32 K/V made here, their bfloat16
    copies, and the index's uint16 bucket ids (``Hkv * N * L``)."""
    _, Hkv, D = SHAPES[shape_name]
    return Hkv * N * (2 * (4 + 2) * D + 2 * L)


def run_one(shape_name, N, args, rng, copy_bw):
    from magicpig_jax import host, lsh
    from magicpig_jax.attention import MagicPIGConfig, build_lsh_index, dense_attention, magicpig_attention

    Hq, Hkv, D = SHAPES[shape_name]
    cfg = MagicPIGConfig(K=args.K, L=args.L, num_sink=4, num_local=64)
    q, k, v = _synthetic(rng, Hq, Hkv, N, D)
    proj = jnp.asarray(rng.standard_normal((D, cfg.K * cfg.L)).astype(np.float32))
    lengths = jnp.asarray([N], jnp.int32)
    t = time.perf_counter()
    hidx = jax.block_until_ready(host.host_build_index(k, proj, cfg, lengths))
    build_s = time.perf_counter() - t
    huge = host.advise_huge_pages(k, v, hidx) if args.huge_pages else 0  # as the decoder does
    huge_kv = huge_page_coverage(k, v)
    # the index's buffers as index_nbytes counts them (ids, offsets, open chunk, bounds): index_bytes and
    # index_to_kv_ratio below describe the same bytes (the open chunk was left out of the first)
    huge_index = huge_page_coverage(hidx.ids, hidx.offsets, hidx.open_codes, hidx.bounds)

    window = cfg.static_window()  # the decoder's default, also host_magicpig_attention's
    attn = jax.jit(lambda q, k, v, i, n: host.host_magicpig_attention(q, k, v, i, cfg, n, static_window=window))
    q_codes = jax.jit(lambda q: lsh.simhash_codes(q, hidx.projections, cfg.K, cfg.L))(q)
    op = jax.jit(lambda q, qc, k, v, i, n: host.host_sampled_attention(q, qc, k, v, i, n, window=window))
    fns = {"op": lambda: op(q, q_codes, k, v, hidx, lengths), "host": lambda: attn(q, k, v, hidx, lengths)}
    with OtherLoad() as load:
        cold = _timed_pair(fns, args.reps, _CopyEvict())  # each call from DRAM, as in a decode step
        warm = _timed_pair(fns, args.reps, None)  # the same query again: its rows partly still in L3
    t_op, t_host = float(np.median(cold["op"])), float(np.median(cold["host"]))
    _, _, ns = attn(q, k, v, hidx, lengths)
    # The baselines as the op: --reps cold calls (caches evicted before each), median. Until
    # 2026-12-04 they were timed warm, the median of reps // 2 calls (2 at --reps 5).
    dense = jax.jit(dense_attention)
    dense_ts = _timed_pair({"dense": lambda: dense(q, k, v, lengths)}, args.reps, _CopyEvict())["dense"]
    t_dense = float(np.median(dense_ts))
    ref = None
    if N <= args.ref_max_n:
        ri = jax.jit(build_lsh_index, static_argnames="config")(k, proj, config=cfg, lengths=lengths)
        reff = jax.jit(lambda q, k, v, ri, n: magicpig_attention(q, k, v, ri, cfg, n))
        ref = float(np.median(_timed_pair({"ref": lambda: reff(q, k, v, ri, lengths)}, args.reps,
                                          _CopyEvict())["ref"]))
        del ri
    n_hashed = int(hidx.end[0] - hidx.start[0])
    ns = np.asarray(ns)
    row_bytes = 2 * D * k.dtype.itemsize
    touched = int(ns.sum()) * row_bytes + _bucket_bytes(hidx, q_codes)
    idx_bytes = host.index_nbytes(hidx)
    res = {
        "shape": shape_name,
        "Hq": Hq,
        "Hkv": Hkv,
        "D": D,
        "N": N,
        "K": cfg.K,
        "L": cfg.L,
        "kv_dtype": "bfloat16",
        "huge_page_bytes": huge,
        "kv_anon_huge_bytes": huge_kv[0], "kv_bytes": huge_kv[1],
        "index_anon_huge_bytes": huge_index[0], "index_bytes": huge_index[1],
        "static_window": window,
        "build_s": build_s,
        "host_attention_ms": 1e3 * t_host,
        "host_op_only_ms": 1e3 * t_op,
        "host_attention_spread_ms": _spread_ms(cold["host"]), "host_op_only_spread_ms": _spread_ms(cold["op"]),
        "host_attention_warm_ms": _spread_ms(warm["host"]), "host_op_only_warm_ms": _spread_ms(warm["op"]),
        "op_alone_over_op_plus_jax": [a / b for a, b in zip(cold["op"], cold["host"], strict=True)],
        "host_op_only_cpu_ms": _spread_ms(cold["op_cpu"]), "host_attention_cpu_ms": _spread_ms(cold["host_cpu"]),
        "other_processes_cpu_fraction": load.fraction,
        "dense_ms": 1e3 * t_dense,
        "dense_spread_ms": _spread_ms(dense_ts),
        "reference_ms": None if ref is None else 1e3 * ref,
        "reference_skipped": None if ref is not None else f"N > --ref-max-n={args.ref_max_n} (memory)",
        "speedup_vs_dense": t_dense / t_host,
        "sampled_fraction": float(ns.mean() / max(n_hashed, 1)),
        "mean_sampled_per_head": float(ns.mean()),
        "bytes_touched": touched,
        "op_ns_per_sampled_key": 1e9 * t_op / max(1, int(ns.sum())),
        "touched_GBps": touched / t_op / 1e9,
        "copy_GBps": copy_bw / 1e9,
        "fraction_of_copy_bw": touched / t_op / copy_bw,
        # Each cold call against the copy timed just before it (the same minute's machine), median.
        "fraction_of_copy_bw_paired": float(np.median([touched / t / bw for t, bw in
                                                       zip(cold["op"], cold["op_copy"], strict=True)])),
        "copy_GBps_paired": {k: v / 1e9 for k, v in _spread(cold["op_copy"]).items()},
        "fraction_of_copy_bw_warm": touched / (1e-3 * _spread_ms(warm["op"])["median"]) / copy_bw,
        "index_bytes_per_token_per_kv_head": idx_bytes / (N * Hkv),
        "kv_bytes_per_token_per_kv_head": row_bytes,
        "index_to_kv_ratio": idx_bytes / (N * Hkv * row_bytes),
        "threads": os.cpu_count(),
    }
    return res


def _plot(results, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for shape in sorted({r["shape"] for r in results}):
        rs = sorted((r for r in results if r["shape"] == shape), key=lambda r: r["N"])
        ns = [r["N"] for r in rs]
        for key, spread, style, what in (("host_attention_ms", "host_attention_spread_ms", "o-", "host MagicPIG"),
                                         ("dense_ms", "dense_spread_ms", "s--", "XLA dense")):
            med = np.array([r[key] for r in rs])
            lo = np.array([r[spread]["min"] if r.get(spread) else r[key] for r in rs])
            hi = np.array([r[spread]["max"] if r.get(spread) else r[key] for r in rs])
            ax.errorbar(ns, med, yerr=[np.maximum(med - lo, 0), np.maximum(hi - med, 0)], fmt=style, capsize=3,
                        label=f"{shape} {what}")
        refs = [(r["N"], r["reference_ms"]) for r in rs if r["reference_ms"] is not None]
        if refs:
            ax.plot(*zip(*refs, strict=True), "^:", label=f"{shape} JAX reference")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context N (tokens)")
    ax.set_ylabel("ms per layer decode step (B=1): median, bars min-max")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    p = Parser(prog="magicpig-jax bench attention", description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="+", default=[8192, 32768, 131072], help="context lengths")
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES), metavar="SHAPE",
                   help=f"head shapes (Hq, Hkv, D) of these models: {', '.join(SHAPES)}")
    p.add_argument("--K", type=int, default=10, help="SimHash bits per table (1..16, the host index)")
    p.add_argument("--L", type=int, default=150, help="hash tables (>= 2)")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions (median, min, max; 5 or more for a result)")
    p.add_argument("--no-huge-pages", dest="huge_pages", action="store_false",
                   help="leave the buffers on 4 KiB pages (to measure what huge pages give)")
    p.add_argument("--ref-max-n", type=int, default=32768,
                   help="skip the pure-JAX reference above this N (its codes and hit counts are O(N*L))")
    p.add_argument("--out", default="runs/bench_attention", help="output prefix (.json and .png)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic keys, queries and projections")
    args = p.parse_args(argv)
    if any(n < 128 for n in args.n):
        p.error("--n values must be >= 128")
    args.n = sorted(set(args.n))
    args.shapes = list(dict.fromkeys(args.shapes))
    need = max(_bytes_needed(s, n, max(args.L, 1)) for s in args.shapes for n in args.n)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        p.error(f"--n {max(args.n)} needs about {need / 2**30:.1f} GiB for its K/V and index, more than this "
                f"machine's {have / 2**30:.1f} GiB")
    try:
        check_output("--out", args.out, "prefix")
    except ValueError as err:
        p.error(str(err))
    if args.seed < 0:
        p.error(f"--seed must be >= 0, got {args.seed}")
    if args.reps < 3:
        p.error("--reps must be >= 3 (every figure is a median with its spread; 5 or more for a result)")
    from magicpig_jax.host.index import HOST_MAX_K

    if not 1 <= args.K <= HOST_MAX_K:
        p.error(f"--K must be in [1, {HOST_MAX_K}] (the host index), got {args.K}")
    if args.L < 2:
        p.error(f"--L must be >= 2, got {args.L}")
    if args.ref_max_n < 0:
        p.error(f"--ref-max-n must be >= 0 (0: never run the pure-JAX reference), got {args.ref_max_n}")
    versions = software_versions()  # the checkout as the run starts (a commit during the run is not its source)
    rng = np.random.default_rng(args.seed)
    copy_bw = _copy_bandwidth()
    results = []
    jobs = [(s, n) for s in args.shapes for n in sorted(args.n)]
    for shape, n in tqdm(jobs, desc="bench attention"):
        results.append(run_one(shape, n, args, rng, copy_bw))
    copy_end = _copy_bandwidth()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    meta = {**versions, "reps": args.reps, "huge_pages": args.huge_pages, "llc_bytes": _llc_bytes(),
            "timing": "op alone and op + static + merge interleaved, each call after a timed copy of "
                      f"{_evict_bytes() >> 20} MiB (>= 4x the LLC and >= 256 MiB: cold, as in a decode step); "
                      "*_warm: the same calls back to back (the query's rows partly in L3); "
                      "fraction_of_copy_bw: the cold median against the copy at the run's start; "
                      "fraction_of_copy_bw_paired: median over the cold calls of each against the copy "
                      "just before it"}
    with open(args.out + ".json", "w") as f:
        json.dump({"copy_GBps": copy_bw / 1e9, "copy_GBps_end": copy_end / 1e9, "meta": meta, "results": results},
                  f, indent=2)
    plotted = _plot(results, args.out + ".png")
    hdr = (
        f"{'shape':14s} {'N':>7s} {'host ms':>8s} {'op ms':>7s} {'op [min,max]':>14s} {'warm':>6s} {'dense ms':>9s} "
        f"{'ref ms':>8s} {'x dense':>7s} {'sampled':>8s} {'GB/s':>6s} {'%copy':>6s} {'%pair':>6s} {'%warm':>6s} "
        f"{'huge':>5s} {'idx/kv':>6s}"
    )
    print(hdr)
    for r in results:
        ref = "skip" if r["reference_ms"] is None else f"{r['reference_ms']:.1f}"
        sp = r["host_op_only_spread_ms"]
        huge = (r["kv_anon_huge_bytes"] + r["index_anon_huge_bytes"]) / max(1, r["kv_bytes"] + r["index_bytes"])
        print(f"{r['shape']:14s} {r['N']:7d} {r['host_attention_ms']:8.2f} {r['host_op_only_ms']:7.2f} "
              f"{'[' + format(sp['min'], '.2f') + ',' + format(sp['max'], '.2f') + ']':>14s} "
              f"{r['host_op_only_warm_ms']['median']:6.2f} {r['dense_ms']:9.1f} {ref:>8s} {r['speedup_vs_dense']:7.1f} "
              f"{r['sampled_fraction']:8.4f} {r['touched_GBps']:6.2f} {100 * r['fraction_of_copy_bw']:6.1f} "
              f"{100 * r['fraction_of_copy_bw_paired']:6.1f} "
              f"{100 * r['fraction_of_copy_bw_warm']:6.1f} {100 * huge:4.0f}% {r['index_to_kv_ratio']:6.3f}")
        if (r["other_processes_cpu_fraction"] or 0) > 0.05:
            print(f"  warning: other processes used {100 * r['other_processes_cpu_fraction']:.0f}% of the CPU time "
                  "while timing: these figures measure time slices, not the op")
    print("host ms: the op with its static part and merge; op ms: the FFI call alone (cold, median, [min, max]); "
          "warm: back to back; dense/ref ms: XLA dense and the pure-JAX reference; x dense: dense ms / host ms; "
          "sampled: fraction of the hashed range's keys (the sinks and local window not counted); "
          "GB/s: bytes touched / op ms; %copy, %pair, %warm: that against the copy bandwidth at the start, beside "
          "each call, and warm; huge: K, V and index bytes on huge pages; idx/kv: index bytes over K and V bytes")
    wrote = f"{args.out}.json" + (" and .png" if plotted else "")
    print(f"copy bandwidth {copy_bw / 1e9:.2f} GB/s (start), {copy_end / 1e9:.2f} GB/s (end); wrote {wrote}")
    return 0 if math.isfinite(copy_bw) else 1


if __name__ == "__main__":
    raise SystemExit(main())
