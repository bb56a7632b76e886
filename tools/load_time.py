"""Seconds for ``load_model()`` of a GGUF in fresh processes, with gguf's reader and with ours.

  python tools/load_time.py --repeats 5 --out examples/results/load/load_time.json

Each repeat starts one process per reader (alternating, so that a drifting machine affects both)
and times ``magicpig_jax.io.loader.load_model`` alone (imports excluded). ``gguf`` swaps in
``gguf.GGUFReader`` for the reader of ``magicpig_jax.io.gguf_model._reader_class`` (a plain
ndarray view of the memory map for the header's fields); the two parse the same fields
(tests/test_loader.py).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import sys, time
import gguf
import magicpig_jax.io.gguf_model as gm
from magicpig_jax.io.loader import load_model
if sys.argv[1] == "gguf":
    gm._READER = gguf.GGUFReader
model = sys.argv[2] if sys.argv[2] != "-" else None
t = time.perf_counter()
load_model(model)
print(time.perf_counter() - t)
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a .gguf file (default: the embedded model)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="write the seconds as JSON")
    args = ap.parse_args(argv)
    if args.repeats < 3:
        ap.error("--repeats must be >= 3 (a median with its spread)")
    seconds: dict[str, list[float]] = {"gguf": [], "plain_view": []}
    for _ in range(args.repeats):
        for reader in seconds:
            out = subprocess.run([sys.executable, "-c", _CHILD, reader, args.model or "-"], capture_output=True,
                                 text=True)
            if out.returncode != 0:  # the loader's own message, not CalledProcessError's
                print(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}",
                      file=sys.stderr)
                return 2
            seconds[reader].append(float(out.stdout.split()[-1]))
    summary = {r: {"median": statistics.median(v), "min": min(v), "max": max(v), "values": v}
               for r, v in seconds.items()}
    for r, s in summary.items():
        print(f"{r:>10}: median {s['median']:.2f} s [{s['min']:.2f}, {s['max']:.2f}] over {args.repeats}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
        args.out.write_text(json.dumps({"model": args.model or "embedded", "cpu": cpu, "results": summary},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
