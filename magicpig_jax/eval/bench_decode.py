"""Batched decode throughput of a model (the embedded SmolLM2 by default): dense vs MagicPIG (host op) vs llama.cpp.

For every prompt length the prompt (real prose: the GPL-3 text, repeated as needed) is
prefilled once, for one row (dense, chunked); its cache is then copied to the B rows of each
batch size (:class:`~magicpig_jax.models.cache.RowBroadcast`), and each method decodes
``--steps`` steps of all B rows together, greedily, ``--repeats`` times (after ``--warmup``
untimed runs). A step decodes one token of every row, so the aggregate throughput is
``B / (seconds per step)``. The first step of every run is not timed (it compiles).

Every timed figure is reported as the median of the repeats with their min and max; the
peak RSS of each (length, B, method) is the process's peak during that configuration (the
kernel's mark is reset before it, :mod:`magicpig_jax.eval.rss`), so it includes the loaded
model and the one-row prefill; the compiled programs of the configurations and prefills before
it are freed first (:func:`magicpig_jax.memory.drop_compiled_programs`), but what earlier
configurations left in the allocator stays in the process, so a peak can grow with what ran
before it (a fresh reviewer measured 547 MB alone and 591 MB after B = 16 at 1K): one
configuration per process (``tools/memory_run.py``) gives a clean peak.

With ``--peer llama.cpp`` the same GGUF file decodes the same prompt ids in llama.cpp
(``llama-cpp-python``, the optional ``peer`` extra) the same way: one prefill, its cache copied
to B sequences, B sequences per ``llama_decode`` (:mod:`magicpig_jax.eval.peer`), in a child
process so that its peak RSS is its own.

Usage: ``magicpig-jax bench decode --batch 1 4 16 --lengths 1024 4096 8192 --peer llama.cpp
--out runs/bench_decode`` writes ``runs/bench_decode.json`` and ``.png``. Not a test: run it
by hand on a quiet machine. Source of the method: arXiv 2410.16179 (Section 5.3 measures
decode throughput against batch size).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from magicpig_jax.argparsing import Parser, check_output, model_input, path_arg
from magicpig_jax.eval.peer import PEERS, llama_cpp_available
from magicpig_jax.eval.rss import OtherLoad, PeakRSS, software_versions

DEFAULT_TEXT = Path("/usr/share/common-licenses/GPL-3")


def prompt_ids(model, text: str, n: int) -> list[int]:
    """The first ``n`` token ids of ``text``, repeated as needed.

    Raises:
      ValueError: an empty text.
    """
    ids = model.tokenizer.encode(text)
    if not ids:
        raise ValueError("the prompt text is empty")
    reps = -(-n // len(ids))
    return (ids * reps)[:n]


def spread(xs: Sequence[float]) -> dict:
    """``{median, min, max, values}`` of the repeats of one figure."""
    return {"median": float(np.median(xs)), "min": float(np.min(xs)), "max": float(np.max(xs)),
            "values": [float(x) for x in xs]}


def throughput_spread(ms: Sequence[float], batch: int) -> dict:
    """``{median, min, max, values}`` of the aggregate tokens/s of repeats that took ``ms`` per step of
    ``batch`` rows, its median ``batch * 1000 / median(ms)`` (with an even number of repeats the median
    of the reciprocals is another number, and the two medians of one JSON row disagreed)."""
    return {"median": 1000.0 * batch / float(np.median(ms)), "min": 1000.0 * batch / float(np.max(ms)),
            "max": 1000.0 * batch / float(np.min(ms)), "values": [1000.0 * batch / float(m) for m in ms]}


def batched_state(state, batch: int):
    """The one-row :class:`PrefillState` ``state`` as ``batch`` rows of the same prompt (the cache is
    copied when decoding starts, :class:`~magicpig_jax.models.cache.RowBroadcast`)."""
    import dataclasses

    import jax.numpy as jnp

    from magicpig_jax.models.cache import RowBroadcast

    if len(state.prompt_lengths) != 1:
        raise ValueError(f"batched_state needs a one-row prefill, got {len(state.prompt_lengths)} rows")
    return dataclasses.replace(
        state, cache=RowBroadcast(state.cache, batch),
        last_logits=jnp.broadcast_to(state.last_logits, (batch, state.last_logits.shape[-1])),
        prompt_lengths=np.repeat(state.prompt_lengths, batch))


def time_method(model, state, method: str, batch: int, steps: int, repeats: int, warmup: int, cfg,
                rss: PeakRSS, **spec_options) -> dict:
    """``repeats`` timed decodes (after ``warmup`` untimed ones) of ``steps`` steps of ``batch`` rows.

    ``spec_options`` override fields of the method's :class:`~magicpig_jax.models.backends.DecodeSpec`
    (e.g. ``offload=True, host_device=...``)."""
    import dataclasses

    import jax.numpy as jnp

    from magicpig_jax.decode_loop import Sampling, start_decode
    from magicpig_jax.generation import decode_spec
    from magicpig_jax.memory import drop_compiled_programs
    from magicpig_jax.models.cache import KVCache

    spec = dataclasses.replace(decode_spec(model, method, cfg, positions=state.cache.capacity), **spec_options)
    # One row decodes in the prefill's own cache, which gets back its prompt length after each
    # run (a step writes only at positions >= the row's length, so the prompt's keys and
    # values are untouched): no copy of the cache, as in a one-shot run. A batch decodes in
    # its B-row copy (RowBroadcast).
    in_place = batch == 1 and isinstance(state.cache, KVCache) and spec.mesh is None and not spec.offload
    # The earlier configurations' compiled programs (other lengths, methods and batch sizes, and
    # the prefills) will not run again: free them and their heap before the mark is reset, so the
    # peak is this configuration's as a one-shot process would see it, not the history's.
    drop_compiled_programs()
    rss.reset()
    ms, fracs, builds, compile_s, rows, runs_on = [], [], [], None, None, None
    loads = []
    for r in range(warmup + repeats):
        st = state if in_place else batched_state(state, batch)
        with OtherLoad() as load:
            run = start_decode(model, st, spec, steps + 1, Sampling(), stop_on_eos=False, consume_prefill=in_place)
            for _ in run:
                pass
            outs, stats = run.outputs, run.stats()
        if in_place:
            state.cache = dataclasses.replace(run.cache, lengths=jnp.asarray(state.prompt_lengths, jnp.int32))
        del run
        loads.append(load.fraction)
        runs_on = stats.get("attention_runs_on")
        del st
        if compile_s is None:
            compile_s = stats["compile_seconds"]
        if r < warmup:
            continue
        ms.append(1000.0 * stats["decode_seconds"] / (stats["decode_steps"] - 1))
        fracs.append(stats["sampled_fraction"])
        builds.append(stats.get("index_build_seconds"))
        rows = outs
    return {
        "batch": batch, "method": method,
        "ms_per_step": spread(ms), "tokens_per_s": throughput_spread(ms, batch),
        "ms_per_token": float(np.median(ms)) / batch,  # aggregate: the median step over its B tokens
        "sampled_fraction": None if fracs[0] is None else float(np.mean(fracs)),
        "index_build_seconds": None if builds[0] is None else float(np.median(builds)),
        "compile_seconds": compile_s, "peak_rss_bytes": rss.peak_bytes(), "runs_on": runs_on,
        "other_processes_cpu_fraction": max((x for x in loads if x is not None), default=None),
        "tokens": rows[0], "rows_identical": all(r == rows[0] for r in rows),
    }


def run_peer(model_path, ids: list[int], batches, steps: int, repeats: int, threads: int | None,
             warmup: int = 0) -> list[dict]:
    """llama.cpp's results for one prompt (:func:`magicpig_jax.eval.peer.llama_cpp_batch_decode`), run in a
    child process (its own peak RSS).

    Raises:
      RuntimeError: the child failed (its stderr is in the message).
    """
    with tempfile.TemporaryDirectory() as tmp:
        ids_path, out_path = Path(tmp) / "ids.json", Path(tmp) / "out.json"
        ids_path.write_text(json.dumps(ids))
        cmd = [sys.executable, "-m", "magicpig_jax.eval.peer", "--model", str(model_path), "--ids", str(ids_path),
               "--batch", *map(str, batches), "--steps", str(steps), "--repeats", str(repeats),
               "--warmup", str(warmup), "--out", str(out_path)]
        if threads:
            cmd += ["--threads", str(threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"llama.cpp peer failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        return json.loads(out_path.read_text())


def ratios(results: list[dict]) -> list[dict]:
    """Per (length, B): MagicPIG's median aggregate throughput over dense's and over llama.cpp's."""
    out = []
    keys = sorted({(r["length"], r["prompt_tokens"], r["batch"]) for r in results})
    for length, n, B in keys:
        tps = {r["method"]: r["tokens_per_s"]["median"] for r in results
               if r["length"] == length and r["batch"] == B}
        row = {"length": length, "prompt_tokens": n, "batch": B}
        if "magicpig" in tps:
            for other in ("dense", "llama.cpp"):
                if other in tps:
                    row[f"magicpig_over_{other.replace('.', '_')}"] = tps["magicpig"] / tps[other]
        out.append(row)
    return out


def make_parser() -> argparse.ArgumentParser:
    """The options of ``magicpig-jax bench decode``."""
    p = Parser(prog="magicpig-jax bench decode", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="the model, as generate's --model (default: the embedded "
                   "SmolLM2-135M-Instruct; --peer needs a GGUF)")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192],
                   help="prompt tokens, each capped at the model's context less --steps + 1 (8192 on an 8K "
                   "model with --steps 64: 8127; the table and the JSON's prompt_tokens give it); a length above "
                   "the context is refused unless --allow-beyond-context, which caps nothing")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes B (rows decoded together)")
    p.add_argument("--methods", nargs="+", default=["dense", "magicpig"], choices=["dense", "magicpig", "magicpig-ref"],
                   metavar="METHOD", help="decode backends: dense, magicpig, magicpig-ref")
    p.add_argument("--steps", type=int, default=32, help="decode steps per run (the first is not timed)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per configuration, >= 3 (median, min, max)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per configuration before the repeats")
    p.add_argument("--K", type=int, default=None, help="SimHash bits per table (1..16, the host index; default 10)")
    p.add_argument("--L", type=int, default=None, help="hash tables (>= 2; default 150)")
    p.add_argument("--layers-per-projection", type=int, default=None,
                   help="consecutive layers sharing one SimHash projection matrix (default 1: one per layer)")
    p.add_argument("--text", type=path_arg, default=DEFAULT_TEXT,
                   help="prose whose tokens, repeated as needed, make the prompts")
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16"], default="float32",
                   help="storage of our KV cache (llama.cpp keeps its own in float16; generate's is bfloat16)")
    p.add_argument("--allow-beyond-context", action="store_true",
                   help="permit prompts longer than the trained context (timing only)")
    p.add_argument("--peer", choices=PEERS, action="append", default=[],
                   help="also time a peer implementation on the same GGUF and prompt ids (llama.cpp)")
    p.add_argument("--peer-threads", type=int, default=None, help="llama.cpp threads (default: every CPU)")
    p.add_argument("--out", default="runs/bench_decode", help="output prefix (.json and .png)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns 0. See the module docstring."""
    from tqdm import tqdm

    from magicpig_jax.attention import MagicPIGConfig
    from magicpig_jax.generation import kv_cache_dtype, prefill
    from magicpig_jax.io.loader import load_model

    p = make_parser()
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error("--steps must be >= 2 (the first step compiles and is not timed)")
    if args.repeats < 3:
        p.error("--repeats must be >= 3 (every figure is a median with its spread)")
    if args.warmup < 0:
        p.error(f"--warmup must be >= 0, got {args.warmup}")
    for flag, values in (("--batch", args.batch), ("--lengths", args.lengths)):
        if min(values) < 1:
            p.error(f"{flag} values must be >= 1, got {min(values)}")
    if args.peer_threads is not None and not args.peer:
        p.error("--peer-threads applies to --peer llama.cpp only, which is not given")
    if args.peer_threads is not None and args.peer_threads < 1:
        p.error(f"--peer-threads must be >= 1, got {args.peer_threads}")
    if not args.text.is_file():
        p.error(f"--text {args.text} is not a file")
    try:
        text = args.text.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        p.error(f"--text {args.text} is not UTF-8 text (byte {err.start})")
    if not text.strip():
        p.error(f"--text {args.text} is empty")
    try:
        check_output("--out", args.out, "prefix", inputs={"--model": model_input(args.model), "--text": args.text})
    except ValueError as err:
        p.error(str(err))
    from magicpig_jax.host.index import HOST_MAX_K

    for flag, values in (("--methods", args.methods), ("--lengths", args.lengths), ("--batch", args.batch)):
        twice = sorted({str(m) for m in values if values.count(m) > 1})
        if twice:  # a configuration twice would be two rows of one figure, and its ratio one of them
            p.error(f"{flag} lists {', '.join(twice)} more than once")
    given = [flag for flag, value in (("--K", args.K), ("--L", args.L),
                                      ("--layers-per-projection", args.layers_per_projection)) if value is not None]
    if given and not {"magicpig", "magicpig-ref"} & set(args.methods):
        p.error(f"{given[0]} applies to methods magicpig and magicpig-ref, neither of which is in --methods")
    args.K = 10 if args.K is None else args.K
    args.L = 150 if args.L is None else args.L
    args.layers_per_projection = 1 if args.layers_per_projection is None else args.layers_per_projection
    if not 1 <= args.K <= HOST_MAX_K:
        p.error(f"--K must be in [1, {HOST_MAX_K}] (the host index), got {args.K}")
    if args.L < 2:
        p.error(f"--L must be >= 2, got {args.L}")
    if args.layers_per_projection < 1:
        p.error(f"--layers-per-projection must be >= 1, got {args.layers_per_projection}")
    if "llama.cpp" in args.peer and not llama_cpp_available():
        p.error("--peer llama.cpp needs llama-cpp-python: pip install -e '.[peer]' (compiles llama.cpp)")
    from magicpig_jax.io.loader import read_model_config

    ctx = read_model_config(args.model).max_position_embeddings
    too_long = [n for n in args.lengths if n > ctx]
    if too_long and not args.allow_beyond_context:
        p.error(f"--lengths {too_long[0]} exceeds the model's context of {ctx} tokens; pass --allow-beyond-context "
                "to run it anyway")
    if not args.allow_beyond_context:  # the prompts the lengths give (below), checked before loading
        if ctx - args.steps - 1 < 1:
            p.error(f"--steps {args.steps} leaves no room for a prompt in the model's context of {ctx}")
        prompts = {}
        for length in args.lengths:
            n = min(length, ctx - args.steps - 1)
            if n in prompts:
                p.error(f"--lengths {prompts[n]} and {length} both give a prompt of {n} tokens (the model's context "
                        f"{ctx} less --steps {args.steps} and 1): keep one")
            prompts[n] = length
    from magicpig_jax.io.embedded import embedded_model_path

    source = embedded_model_path() if args.model in (None, "embedded") else Path(args.model)
    if args.peer and Path(source).suffix != ".gguf":  # before the load (minutes for a large model)
        p.error(f"--peer needs a .gguf --model (llama.cpp reads GGUF only), got {source}")
    versions, started = software_versions(), time.strftime("%Y-%m-%d %H:%M")  # the checkout as the run starts
    model = load_model(args.model)
    cfg = MagicPIGConfig(K=args.K, L=args.L, layers_per_projection=args.layers_per_projection)
    from magicpig_jax.generation import cache_capacity, decode_spec

    for length in args.lengths:  # every method's spec (e.g. a sliding window) before any timing
        n = length if args.allow_beyond_context else min(length, ctx - args.steps - 1)
        for method in args.methods:
            decode_spec(model, method, cfg, positions=cache_capacity(model, max(n, 1), args.steps + 1,
                                                                      args.allow_beyond_context))
    rss = PeakRSS()
    results = []
    bar = tqdm(total=len(args.lengths) * len(args.batch) * (len(args.methods) + len(args.peer)), desc="bench decode")
    ctx = model.config.max_position_embeddings
    for length in args.lengths:
        # The decoded tokens must fit in the model's context: at --lengths 8192 on an 8K model
        # the prompt is 8192 - steps - 1 tokens (``length`` keeps the requested figure).
        n = length if args.allow_beyond_context else min(length, ctx - args.steps - 1)
        if n < 1:
            p.error(f"--steps {args.steps} leaves no room for a prompt in the model's context of {ctx}")
        if n < length:
            tqdm.write(f"--lengths {length}: a prompt of {n} tokens, so that the {args.steps} steps fit the model's "
                       f"context of {ctx}")
        ids = prompt_ids(model, text, n)
        if "llama.cpp" in args.peer:
            for r in run_peer(model.source, ids, args.batch, args.steps, args.repeats, args.peer_threads,
                              args.warmup):
                r.update(length=length, prompt_tokens=n, method="llama.cpp", sampled_fraction=None)
                results.append(r)
                bar.update(1)
        state = prefill(model, [ids], args.steps + 1, allow_beyond_context=args.allow_beyond_context,
                        cache_dtype=kv_cache_dtype(args.kv_dtype))
        for B in args.batch:
            for method in args.methods:
                r = time_method(model, state, method, B, args.steps, args.repeats, args.warmup, cfg, rss)
                r.update(length=length, prompt_tokens=n, prefill_seconds=state.seconds,
                         prefill_compile_seconds=state.compile_seconds)
                results.append(r)
                bar.update(1)
        del state
    bar.close()
    _agreement(results)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)) or ".", exist_ok=True)
    meta = {**versions, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "time": started,
            "K": args.K, "L": args.L, "layers_per_projection": args.layers_per_projection,
            "steps": args.steps, "repeats": args.repeats, "warmup": args.warmup,
            "kv_dtype": args.kv_dtype, "peak_rss_resettable": rss.resettable,
            "note": "ms_per_step: seconds of the timed steps (all but the first) of one run / their number; "
                    "tokens_per_s: B tokens per step (aggregate); each as median/min/max over the repeats; "
                    "peak_rss_bytes: the process's peak during the configuration (ours: with the loaded model and "
                    "the one-row prefill; llama.cpp: its own child process); tokens_equal_to_dense: greedy tokens "
                    "of row 0 equal position by position to our dense decode of the same prompt and B; "
                    "ratios: magicpig_over_X is MagicPIG's median tokens/s over X's (above 1: MagicPIG is faster, "
                    "at every B); tokens_per_s median: B x 1000 / the ms_per_step median (with an even number of "
                    "repeats the median of the reciprocals differs); prefill_seconds: ours includes its "
                    "compilation (prefill_compile_seconds), llama.cpp's has none; peak_rss_bytes also holds what "
                    "earlier configurations of the process left in the allocator (one configuration per process "
                    "for a clean peak: tools/memory_run.py)"}
    _print(results)
    _warn_if_busy(results)
    with open(args.out + ".json", "w") as f:
        json.dump({"meta": meta, "results": results, "ratios": ratios(results)}, f, indent=2)
    _plot(results, args.out + ".png")
    print(f"wrote {args.out}.json and {args.out}.png")
    return 0


def _warn_if_busy(results: list[dict]) -> None:
    busy = [r for r in results if (r.get("other_processes_cpu_fraction") or 0) > 0.05]
    if busy:
        print(f"warning: other processes used > 5% of the CPU during {len(busy)} of {len(results)} configurations "
              f"(up to {100 * max(r['other_processes_cpu_fraction'] for r in busy):.0f}%): those timings measure time "
              "slices; rerun on a quiet machine")


def _agreement(results: list[dict]) -> None:
    for r in results:
        dense = next((d["tokens"] for d in results if d["method"] == "dense"
                      and d["prompt_tokens"] == r["prompt_tokens"] and d["batch"] == r["batch"]), None)
        r["tokens_equal_to_dense"] = (None if dense is None else
                                      sum(a == b for a, b in zip(dense, r["tokens"], strict=False)))


def _print(results: list[dict]) -> None:
    print(f"{'prompt':>7} {'B':>3} {'method':>10} {'ms/step':>22} {'tok/s (agg.)':>22} {'peak RSS':>10} "
          f"{'sampled':>8} {'= dense':>8}")
    for r in results:
        m, t = r["ms_per_step"], r["tokens_per_s"]
        frac = "-" if r["sampled_fraction"] is None else f"{100 * r['sampled_fraction']:.2f}%"
        same = "-" if r["tokens_equal_to_dense"] is None else f"{r['tokens_equal_to_dense']}/{len(r['tokens'])}"
        print(f"{r['prompt_tokens']:>7} {r['batch']:>3} {r['method']:>10} "
              f"{m['median']:>8.1f} [{m['min']:.1f}, {m['max']:.1f}] {t['median']:>8.1f} [{t['min']:.1f}, "
              f"{t['max']:.1f}] {r['peak_rss_bytes'] / 1e9:>7.2f}GB {frac:>8} {same:>8}")
    print("(ms/step and tok/s: median [min, max] over the repeats; '= dense': of row 0's greedy tokens, how many "
          "equal dense's at the same position: after the first difference the continuations diverge)")
    for row in ratios(results):
        parts = [f"{k.removeprefix('magicpig_over_').replace('_', '.')} {v:.2f}x" for k, v in row.items()
                 if k.startswith("magicpig_over")]
        if parts:
            print(f"{row['prompt_tokens']:>7} tokens, B={row['batch']:>2}: MagicPIG's tokens/s over "
                  + ", ".join(parts))


def _plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["prompt_tokens"] for r in results})
    fig, axes = plt.subplots(1, len(lengths), figsize=(4 * len(lengths), 3.6), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], lengths, strict=True):
        for method in dict.fromkeys(r["method"] for r in results):
            rs = sorted((r for r in results if r["method"] == method and r["prompt_tokens"] == n),
                        key=lambda r: r["batch"])
            if not rs:
                continue
            b = [r["batch"] for r in rs]
            med = np.array([r["tokens_per_s"]["median"] for r in rs])
            err = np.array([[med[i] - r["tokens_per_s"]["min"], r["tokens_per_s"]["max"] - med[i]]
                            for i, r in enumerate(rs)]).T
            ax.errorbar(b, med, yerr=err, fmt="o-", capsize=3, label=method)
        ax.set_title(f"{n} prompt tokens")
        ax.set_xlabel("batch B")
        ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("aggregate tokens/s (median, min-max)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
