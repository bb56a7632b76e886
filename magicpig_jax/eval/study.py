"""Study: relative error of attention estimators versus the fraction of keys they touch.

Estimators (all from :mod:`magicpig_jax.attention`): exact TopK, Quest (16-token
pages), oracle sampling (Definition 3.1), MagicPIG for several ``(K, L)``, with and
without key centering, and the hybrid estimator (``--heavy`` thresholds: keys colliding in
that many tables kept exactly, the rest weighted by ``1/u_c``; the same sampled set). For
each attention head the error is ``||o_hat - o|| / ||o||`` against :func:`dense_attention`; random estimators are
averaged over ``--repeats`` seeds. The cost is the fraction of keys touched:
kept keys for TopK/Quest, distinct drawn keys for oracle sampling, sampled plus
static keys for MagicPIG.

Sources of q/k/v:

* ``synthetic``: long-tailed score distributions built so that the logits follow a
  chosen profile exactly (Gaussian logits of several spreads, a Zipf law, heavy
  hitters on a flat background), with all keys in a narrow cone roughly opposite the
  query as the paper observes for real keys (arXiv 2410.16179, Section 4.2, Fig. 6).
* ``--capture PATH``: an ``.npz`` with ``q [layers, Hq, D]``, ``k`` and
  ``v [layers, Hkv, N, D]`` captured from a model at one decode step (every key
  is treated as valid), and optionally ``attn_logit_softcap`` (a float scalar, 0 for none):
  the model's attention logit soft-capping (Gemma 2), with which the dense reference and every
  estimator cap their logits. Each layer is one case.

Writes ``study.json`` (every measurement and a per-method summary) and
``study.png`` (matplotlib; ``--no-plot`` skips it)
into ``--out``. Usage: ``magicpig-jax study attention --out runs/study [--capture q.npz]``.

The measurement is :mod:`magicpig_jax.eval.study_measure`, the figure
:mod:`magicpig_jax.eval.study_plot`. The cost model of ``proofs/cost_model.md``
(:func:`expected_sampled_fraction`, :func:`tables_for_fraction`) lives with the method in
:mod:`magicpig_jax.attention.cost_model` and is re-exported here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from magicpig_jax import lsh
from magicpig_jax.argparsing import Parser, check_output, in_flag_terms, path_arg
from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.attention._common import check_softcap
from magicpig_jax.attention.cost_model import expected_sampled_fraction, tables_for_fraction
from magicpig_jax.eval.study_measure import (
    DEFAULT_FRACTIONS,
    DEFAULT_HEAVY,
    DEFAULT_LSH,
    PROFILES,
    StudySettings,
    run_case,
    summarize,
    synthetic_case,
)
from magicpig_jax.eval.study_plot import plot_study

__all__ = [
    "main",
    "make_parser",
    "expected_sampled_fraction",
    "tables_for_fraction",
    "synthetic_case",
    "PROFILES",
    "StudySettings",
    "run_case",
]


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    try:
        out = tuple(tuple(int(x) for x in item.lower().split("x")) for item in text.split(",") if item.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected KxL pairs like 10x150,11x300, got {text!r}") from err
    if not out or any(len(p) != 2 for p in out):
        raise argparse.ArgumentTypeError(f"expected KxL pairs like 10x150,11x300, got {text!r}")
    return out  # type: ignore[return-value]


def _fractions(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, got {text!r}") from err
    if not out or any(not 0 < f <= 1 for f in out):
        raise argparse.ArgumentTypeError(f"fractions must be in (0, 1], got {text!r}")
    return out


DEFAULT_CAPTURE_TEXT = Path("/usr/share/common-licenses/GPL-3")


def make_parser() -> argparse.ArgumentParser:
    """The argument parser of ``magicpig-jax study attention`` (its epilog points at the module docstring)."""
    p = Parser(prog="magicpig-jax study attention", description=__doc__.splitlines()[0],
               epilog="Details (method, outputs, sources): python -m pydoc magicpig_jax.eval.study")
    p.add_argument("--out", type=path_arg, default=Path("runs/study"), help="output directory")
    p.add_argument("--capture", type=path_arg, default=None,
                   help=".npz with q [layers, Hq, D], k and v [layers, Hkv, N, D]")
    p.add_argument("--capture-from-model", action="store_true",
                   help="capture q/k/v from the embedded SmolLM2 on --capture-text first (written to OUT/capture.npz)")
    p.add_argument("--capture-text", type=path_arg, default=None,
                   help=f"real prose prefilled for --capture-from-model (default: {DEFAULT_CAPTURE_TEXT}, the GPL-3, "
                        "7.6K tokens)")
    p.add_argument("--no-synthetic", action="store_true", help="skip the synthetic cases")
    p.add_argument("--profiles", default=",".join(PROFILES), help=f"synthetic profiles, subset of {PROFILES}")
    p.add_argument("--n", type=int, default=4096, help="synthetic keys per head")
    p.add_argument("--head-dim", type=int, default=64, help="synthetic head dimension")
    p.add_argument("--heads", type=int, default=4, help="synthetic heads per case")
    p.add_argument("--layers", default=None, help="comma-separated capture layers (default: all)")
    p.add_argument("--fractions", type=_fractions, default=",".join(map(str, DEFAULT_FRACTIONS)),
                   help="budgets of TopK / Quest / oracle sampling as fractions of the context")
    p.add_argument("--lsh", type=_pairs, default=",".join(f"{k}x{l}" for k, l in DEFAULT_LSH),
                   help="MagicPIG (K, L) pairs, e.g. 10x150,11x300")
    p.add_argument("--heavy", default=",".join(map(str, DEFAULT_HEAVY)),
                   help="hybrid heavy thresholds (collisions, >= 3; empty: no hybrid)")
    p.add_argument("--num-sink", type=int, default=4, help="sink tokens kept exactly")
    p.add_argument("--num-local", type=int, default=64, help="local window of the prompt kept exactly")
    p.add_argument("--page-size", type=int, default=16, help="Quest page size")
    p.add_argument("--repeats", type=int, default=4, help="seeds per random estimator")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic cases and the estimators")
    p.add_argument("--no-plot", action="store_true", help="write the JSON only")
    return p


def _load_capture(path: Path, layers: str | None):
    if not path.exists():
        raise FileNotFoundError(f"--capture file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(6)
    if magic[:4] != b"PK\x03\x04" and magic != b"\x93NUMPY":  # neither a zip (.npz) nor an .npy
        raise ValueError(f"--capture {path} is not an .npz file (needs arrays q, k, v, as `capture` writes)")
    try:
        npz = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as err:
        raise ValueError(f"--capture {path} is not an .npz of arrays q, k, v ({err})") from None
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise ValueError(f"--capture {path} is a single .npy array, not an .npz of arrays q, k, v")
    with npz as z:
        missing = [name for name in ("q", "k", "v") if name not in z]
        if missing:
            raise ValueError(f"--capture {path} lacks arrays {missing} (needs q, k, v)")
        q, k, v = (np.asarray(z[name], np.float32) for name in ("q", "k", "v"))
        cap = z["attn_logit_softcap"] if "attn_logit_softcap" in z else np.float32(0.0)
    if cap.shape != () or not np.issubdtype(cap.dtype, np.floating):
        raise ValueError(f"--capture {path}: attn_logit_softcap must be a float scalar (0 for none), got "
                         f"{cap.dtype} {cap.shape}")
    try:
        cap = check_softcap(None if float(cap) == 0.0 else float(cap), "attn_logit_softcap")
    except ValueError as err:
        raise ValueError(f"--capture {path}: {err} (0 for none)") from None
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not np.isfinite(x).all():
            raise ValueError(f"--capture {path}: array {name} holds {int((~np.isfinite(x)).sum())} NaN or infinite "
                             "values; the study needs finite q, k, v")
    if q.ndim != 3 or k.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[3]:
        raise ValueError(
            f"--capture needs q [layers, Hq, D], k/v [layers, Hkv, N, D]; got q {q.shape}, k {k.shape}, v {v.shape}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"--capture: Hq ({q.shape[1]}) must be a multiple of Hkv ({k.shape[1]})")
    idx = range(q.shape[0]) if layers is None else [int(x) for x in layers.split(",") if x.strip()]
    for i in idx:
        if not 0 <= i < q.shape[0]:
            raise ValueError(f"--layers: layer {i} out of range [0, {q.shape[0]})")
    return [(f"layer{i}", q[i : i + 1], k[i : i + 1], v[i : i + 1], cap) for i in idx]


def _check_synthetic_memory(n: int, head_dim: int, heads: int, pairs) -> None:
    """Refuse synthetic cases larger than this machine's memory, before drawing them.

    Per key and head a case holds q, k, v and their float64 reference's copies (about 6 D floats),
    per (K, L) the float32 projections ``[n, K*L]`` (the largest temporary) and the codes and
    estimator temporaries (about 3 L); 4 bytes each. This bounds the measured peak (a 1-head case at
    K = 11, L = 300, D = 64 peaked near 16 KB per key, the estimate 18 KB).
    """
    width = max(6 * head_dim + 3 * L + K * L for K, L in pairs)
    need = 4 * heads * n * width
    try:
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf: no check
        return
    if need > have:
        raise ValueError(f"--n {n} x --heads {heads} at --head-dim {head_dim} and --lsh up to K*L = "
                         f"{max(K * L for K, L in pairs)} needs about {need / 1e9:.3g} GB for the synthetic cases, "
                         f"more than this machine's {have / 1e9:.3g} GB: choose smaller sizes")


def _settings(args) -> tuple[StudySettings, list[str]]:
    """Validate the parsed arguments: the study settings and the synthetic profiles."""
    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    bad = [p for p in profiles if p not in PROFILES]
    if bad:
        raise ValueError(f"--profiles: unknown {', '.join(bad)}; choose from {', '.join(PROFILES)}")
    twice = sorted({p for p in profiles if profiles.count(p) > 1})
    if twice:
        raise ValueError(f"--profiles lists {', '.join(twice)} more than once")
    if not profiles and not args.no_synthetic:
        raise ValueError(f"--profiles is empty; choose from {', '.join(PROFILES)} (or pass --no-synthetic)")
    if args.layers is not None and args.capture is None and not args.capture_from_model:
        raise ValueError("--layers selects capture layers: it needs --capture or --capture-from-model")
    if args.capture_text is not None and not args.capture_from_model:
        raise ValueError("--capture-text is the prose prefilled for --capture-from-model: it needs that flag")
    for flag, value, low in (("--n", args.n, 8), ("--head-dim", args.head_dim, 1), ("--heads", args.heads, 1),
                             ("--repeats", args.repeats, 1), ("--page-size", args.page_size, 1),
                             ("--seed", args.seed, 0), ("--num-sink", args.num_sink, 0),
                             ("--num-local", args.num_local, 0)):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    with in_flag_terms(K="--lsh K", L="--lsh L"):
        for K, L in args.lsh:
            lsh.validate_k_l(K, L)
    if not args.no_synthetic:
        _check_synthetic_memory(args.n, args.head_dim, args.heads, args.lsh)
    try:
        heavy = tuple(int(x) for x in args.heavy.split(",") if x.strip())
    except ValueError as err:
        raise ValueError(f"--heavy takes comma-separated integers, got {args.heavy!r}") from err
    if any(m < 3 for m in heavy):
        raise ValueError(f"--heavy thresholds must be >= 3, got {args.heavy!r}")
    # a threshold above L + 1 collisions is skipped for that (K, L); one that no --lsh can reach never runs
    never = [m for m in heavy if all(m > L + 1 for _, L in args.lsh)]
    if never and args.heavy != ",".join(map(str, DEFAULT_HEAVY)):  # asked for, not the default
        raise ValueError(f"--heavy thresholds {never} exceed L + 1 for every --lsh (K, L): they would never run")
    settings = StudySettings(fractions=args.fractions, lsh=args.lsh, num_sink=args.num_sink,
                             num_local=args.num_local, page_size=args.page_size, repeats=args.repeats,
                             seed=args.seed, heavy=heavy)
    MagicPIGConfig(num_sink=args.num_sink, num_local=args.num_local, seed=args.seed)  # validates
    return settings, profiles


def _cases(args, profiles: list[str]) -> list[tuple]:
    """``(source, name, q, k, v, softcap)`` for every synthetic profile and captured layer (may capture
    first); ``softcap``: the captured model's attention logit soft-capping, None for none."""
    cases = []
    if not args.no_synthetic:
        rng = np.random.default_rng(args.seed)
        for profile in profiles:
            cases.append(("synthetic", profile, *synthetic_case(rng, profile, args.n, args.head_dim, args.heads),
                          None))
    if args.capture_from_model:
        if args.capture is not None:
            raise ValueError("--capture-from-model and --capture are exclusive")
        from magicpig_jax.eval.capture import capture_qkv
        from magicpig_jax.io.loader import load_model

        text = DEFAULT_CAPTURE_TEXT if args.capture_text is None else args.capture_text
        if not text.is_file():
            raise FileNotFoundError(f"--capture-text {text} is not a file")
        data = capture_qkv(load_model(), text.read_text(encoding="utf-8"))
        args.out.mkdir(parents=True, exist_ok=True)
        args.capture = args.out / "capture.npz"
        np.savez(args.capture, **data)
    if args.capture is not None:
        cases += [("capture", *case) for case in _load_capture(args.capture, args.layers)]
    if not cases:
        raise ValueError("nothing to study: --no-synthetic without --capture")
    return cases


def main(argv: list[str] | None = None) -> int:
    """Run the study; returns 0 (writes ``study.json`` and ``study.png`` into ``--out``).

    Raises:
      ValueError: bad arguments or a malformed capture (the CLI reports it and exits 2).
      FileNotFoundError: ``--capture`` does not exist.
    """
    args = make_parser().parse_args(argv)
    if args.capture is not None and not args.capture.is_file():
        raise FileNotFoundError(f"--capture {args.capture} is not a file (an .npz of magicpig_jax.eval.capture)")
    settings, profiles = _settings(args)
    check_output("--out", args.out, "dir")
    cases = _cases(args, profiles)
    per_case = 3 * len(settings.fractions) + sum(2 + sum(3 <= m <= L + 1 for m in settings.heavy)
                                                 for _, L in settings.lsh)
    from magicpig_jax.eval.rss import software_versions

    versions = software_versions()  # the checkout as the run starts (a commit during the run is not its source)
    records: list[dict] = []
    t0 = time.perf_counter()
    with tqdm(total=per_case * len(cases), desc="study attention", unit="run") as bar:
        for source, name, q, k, v, softcap in cases:
            bar.set_postfix_str(f"{source}:{name}")
            for r in run_case(q, k, v, settings, bar, softcap=softcap):
                records.append({"source": source, "case": name, "N": int(k.shape[2]), "attn_logit_softcap": softcap,
                                **r})
    summary = summarize(records)
    args.out.mkdir(parents=True, exist_ok=True)
    synthetic = None if args.no_synthetic else {"n": args.n, "head_dim": args.head_dim, "heads": args.heads,
                                                "profiles": [p.strip() for p in args.profiles.split(",") if p.strip()]}
    result = {
        "settings": dataclasses.asdict(settings) | {"capture": str(args.capture) if args.capture else None,
                                                    "synthetic": synthetic},
        "meta": versions,  # jax, jaxlib, the source revision and the CPU
        "seconds": time.perf_counter() - t0,
        "summary": summary,
        "records": records,
    }
    (args.out / "study.json").write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        plot_study(summary, args.out / "study.png")
    print(f"{'source':9s} {'method':10s} {'params':50s} {'cases':>5s} {'keys %':>7s} {'rel. error':>10s} "
          f"{'median':>7s}")
    for row in summary:  # the means the plot shows; every case is in study.json
        params = ",".join(f"{k}={v}" for k, v in row["params"].items())
        print(f"{row['source']:9s} {row['method']:10s} {params:50s} {row['cases']:5d} {100 * row['fraction']:7.2f} "
              f"{row['rel_error']:10.4f} {row['rel_error_median']:7.4f}")
    print(f"wrote {args.out / 'study.json'}" + ("" if args.no_plot else f" and {args.out / 'study.png'}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
