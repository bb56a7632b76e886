"""The jax 0.12.0.1 / 0.12.1 A/B of `run.sh` as a Markdown table: ms per step (median [min, max] of
each run's 3 repeats), the ratio of the two versions' medians of their run medians, and peak RSS."""

import json
import statistics
from pathlib import Path

DIR = Path(__file__).parent
VERSIONS = {"old": "jax0.12.0.1", "new": "jax0.12.1"}


def runs() -> dict:
    rows: dict = {}
    for side, version in VERSIONS.items():
        for r in (1, 2):
            data = json.loads((DIR / f"bench_decode_{version}_r{r}.json").read_text())
            for x in data["results"]:
                key = (x["length"], x["batch"], x["method"])
                ms = x["ms_per_step"]
                rows.setdefault(key, {}).setdefault(side, []).append(
                    (ms["median"], ms["min"], ms["max"], x["peak_rss_bytes"]))
    return rows


def cell(values) -> str:
    return ", ".join(f"{m:.2f} [{lo:.2f}, {hi:.2f}]" for m, lo, hi, _ in values)


def main() -> None:
    print("| prompt | B | method | jax 0.12.0.1 ms/step (run 1, run 2) | jax 0.12.1 ms/step (run 1, run 2) "
          "| 0.12.1 / 0.12.0.1 | peak RSS GB, 0.12.0.1 → 0.12.1 |")
    print("|---:|---:|---|---|---|---:|---|")
    for key, sides in sorted(runs().items()):
        old, new = sides["old"], sides["new"]
        ratio = statistics.median(v[0] for v in new) / statistics.median(v[0] for v in old)
        rss = f"{max(v[3] for v in old) / 1e9:.2f} → {max(v[3] for v in new) / 1e9:.2f}"
        print(f"| {key[0]} | {key[1]} | {key[2]} | {cell(old)} | {cell(new)} | {ratio:.3f} | {rss} |")


if __name__ == "__main__":
    main()
