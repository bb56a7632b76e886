"""Study: relative error of attention estimators versus the fraction of keys they touch.

Estimators (all from :mod:`magicpig_jax.attention`): exact TopK, Quest (16-token
pages), oracle sampling (Definition 3.1) and MagicPIG for several ``(K, L)``, with and
without key centering. For each attention head the error is
``||o_hat - o|| / ||o||`` against :func:`dense_attention`; random estimators are
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
  is treated as valid). Each layer is one case.

Writes ``study.json`` (every measurement and a per-method summary) and
``study.png`` (matplotlib; ``--no-plot`` skips it)
into ``--out``. Usage: ``magicpig-jax study attention --out runs/study [--capture q.npz]``.

Also provides the cost model of ``proofs/cost_model.md``: the expected sampled
fraction ``mean_i u(cos_i; K, L)`` of a cosine distribution and the smallest ``L``
reaching a target fraction (:func:`expected_sampled_fraction`, :func:`tables_for_fraction`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Float
from tqdm import tqdm

from magicpig_jax import lsh
from magicpig_jax.attention import (
    MagicPIGConfig,
    build_lsh_index,
    dense_attention,
    magicpig_attention,
    oracle_sampling_attention,
    quest_attention,
    topk_attention,
)
from magicpig_jax.attention.baselines import quest_mask

__all__ = [
    "main",
    "expected_sampled_fraction",
    "tables_for_fraction",
    "synthetic_case",
    "PROFILES",
    "run_case",
]

PROFILES = ("gauss1", "gauss2", "gauss3", "zipf", "heavy_hitters")
DEFAULT_FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
DEFAULT_LSH = ((8, 60), (9, 100), (10, 150), (10, 170), (11, 300))


# ----------------------------------------------------------------------------- cost model


def expected_sampled_fraction(cosines: Float[np.ndarray, " n"], K: int, L: int) -> float:
    """Expected fraction of hashed keys MagicPIG samples: ``mean_i u(p_i; K, L)``.

    ``p_i = 1 - arccos(cos_i)/pi`` and ``u`` is :func:`magicpig_jax.lsh.sampling_probability`;
    by linearity of expectation the expected number of sampled keys is ``sum_i u_i``
    whatever the dependence between keys (proofs/cost_model.md).

    Args:
      cosines: float ``[n]`` (any shape) cosines between the query and the centered keys, n >= 1.
      K: bits per table, 1..32.
      L: tables, >= 2.

    Returns:
      A float in ``[0, 1]``.

    Raises:
      ValueError: empty ``cosines``, NaN cosines, or invalid ``K``/``L``.
      TypeError: non-integer ``K``/``L``.

    Source: arXiv 2410.16179, Section 4.2 (Eq. (9)) and Section 5 (cost ~ fraction sampled).
    """
    lsh.validate_k_l(K, L)
    c = np.asarray(cosines, np.float64).ravel()
    if c.size == 0:
        raise ValueError("cosines must not be empty")
    if np.any(np.isnan(c)):
        raise ValueError("cosines must not contain NaN")
    p = lsh.collision_probability_from_cosine(jnp.asarray(c, jnp.float32))
    return float(np.mean(np.asarray(lsh.sampling_probability(p, K, L), np.float64)))


def tables_for_fraction(
    cosines: Float[np.ndarray, " n"], K: int, target: float, max_L: int = 1 << 20
) -> int:
    """The smallest ``L >= 2`` whose expected sampled fraction reaches ``target``.

    ``u`` is strictly increasing in ``L`` (``u(L+1) - u(L) = L P^2 (1-P)^(L-1)``), so
    the fraction is too and an exponential + binary search finds the boundary.

    Args:
      cosines: float ``[n]`` cosines between the query and the centered keys.
      K: bits per table, 1..32.
      target: fraction in ``(0, 1)``.
      max_L: the largest L considered.

    Returns:
      int ``L`` with ``expected_sampled_fraction(cosines, K, L) >= target`` and
      (if ``L > 2``) ``expected_sampled_fraction(cosines, K, L - 1) < target``.

    Raises:
      ValueError: ``target`` outside ``(0, 1)``, or not reachable with ``L <= max_L``.

    Source: proofs/cost_model.md.
    """
    if not (isinstance(target, float | int) and 0 < target < 1):
        raise ValueError(f"target must be a fraction in (0, 1), got target={target!r}")
    lsh.validate_k_l(K, 2)

    def f(L: int) -> float:
        return expected_sampled_fraction(cosines, K, L)

    if f(2) >= target:
        return 2
    lo, hi = 2, 4
    while f(hi) < target:
        lo, hi = hi, hi * 2
        if hi > max_L:
            if f(max_L) < target:
                raise ValueError(f"target fraction {target} is not reached with K={K} and L <= {max_L}")
            hi = max_L
            break
    while hi - lo > 1:  # invariant: f(lo) < target <= f(hi)
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if f(mid) >= target else (mid, hi)
    return hi


# ----------------------------------------------------------------------------- synthetic data


def synthetic_case(
    rng: np.random.Generator, profile: str, n: int = 4096, d: int = 64, heads: int = 4
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q ``[1, H, d]``, k and v ``[1, H, n, d]`` (float32, one KV head per query head) with a given logit profile.

    Each head's logits ``q·k_i/sqrt(d)`` equal a target ``t_i`` plus one constant:
    ``k_i = (t_i sqrt(d)/|q| - c) q_hat + m_perp + z_i`` with ``z_i`` and ``m_perp``
    orthogonal to q, so all keys lie in a cone around a common offset that has a
    component against the query (arXiv 2410.16179, Section 4.2). The first 4 keys
    are attention sinks (logit 2 above the largest other one). Profiles of ``t``:

    * ``gauss1`` / ``gauss2`` / ``gauss3``: i.i.d. normal logits with standard deviation 1, 2, 3
      (the larger, the more concentrated; std 1-2 is long-tailed: the top 20% of keys
      hold well under 90% of the mass);
    * ``zipf``: ``t = -0.9 log(rank)`` in random positions (a power law);
    * ``heavy_hitters``: normal(0, 0.5) background plus 16 keys at +5.

    Values are a per-head mean vector plus unit Gaussian noise (so ``||o||`` does not
    vanish for flat attention and the relative error stays meaningful).

    Raises:
      ValueError: unknown profile, or n < 8.
    """
    if profile not in PROFILES:
        raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
    if n < 8:
        raise ValueError(f"n must be >= 8, got n={n}")
    q = rng.normal(size=(heads, d))
    k = np.empty((heads, n, d))
    for h in range(heads):
        m_rest = n - 4
        if profile.startswith("gauss"):
            t = rng.normal(size=m_rest) * float(profile[-1])
        elif profile == "zipf":
            t = -0.9 * np.log(rng.permutation(m_rest) + 1.0)
        else:
            t = rng.normal(size=m_rest) * 0.5
            t[rng.choice(m_rest, min(16, m_rest), replace=False)] += 5.0
        t = np.concatenate([np.full(4, t.max() + 2.0), t])  # 4 sinks in front
        qn = np.linalg.norm(q[h])
        qh = q[h] / qn
        z = rng.normal(size=(n, d))
        z -= np.outer(z @ qh, qh)
        m = rng.normal(size=d) * 2.0
        m -= (m @ qh) * qh
        k[h] = np.outer(t * math.sqrt(d) / qn - 1.5, qh) + m + z
    v = rng.normal(size=(1, heads, 1, d)) + rng.normal(size=(1, heads, n, d))  # values share a mean
    return q[None].astype(np.float32), k[None].astype(np.float32), v.astype(np.float32)


# ----------------------------------------------------------------------------- measurement


@dataclasses.dataclass
class StudySettings:
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    lsh: tuple[tuple[int, int], ...] = DEFAULT_LSH
    num_sink: int = 4
    num_local: int = 64
    page_size: int = 16
    repeats: int = 4
    seed: int = 0


def _rel_err(est, ref) -> np.ndarray:
    """``||est - ref|| / ||ref||`` per (row, head): float64 ``[Hq]`` of row 0."""
    est, ref = np.asarray(est, np.float64)[0], np.asarray(ref, np.float64)[0]
    return np.linalg.norm(est - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)


_dense = jax.jit(dense_attention)
_topk = jax.jit(topk_attention, static_argnames="budget")
_quest = jax.jit(quest_attention, static_argnames=("page_size", "budget"))
_quest_mask = jax.jit(quest_mask, static_argnames=("page_size", "budget"))
_build = jax.jit(build_lsh_index, static_argnames=("config", "center"))
_magicpig = jax.jit(magicpig_attention, static_argnames="config")


@jax.jit
def _centered_cosines(q, k, mean):
    """cos(q_h, k_i - mean) for every head and key: ``[Hq, N]`` (row 0)."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    kc = (k - mean[:, :, None, :])[0]  # [Hkv, N, D]
    qg = q[0].reshape(Hkv, Hq // Hkv, D)
    dots = jnp.einsum("hgd,hnd->hgn", qg, kc, precision=jax.lax.Precision.HIGHEST)
    norms = jnp.linalg.norm(qg, axis=-1)[..., None] * jnp.linalg.norm(kc, axis=-1)[:, None, :]
    return jnp.where(norms > 0, dots / jnp.where(norms > 0, norms, 1.0), 0.0).reshape(Hq, -1)


def _oracle_many(budget: int | float):
    def f(keys, q, k, v):
        return jax.vmap(lambda r: oracle_sampling_attention(r, q, k, v, budget))(keys)

    return jax.jit(f)


def run_case(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, settings: StudySettings, progress: tqdm | None = None
) -> list[dict]:
    """Every estimator on one case: q ``[1, Hq, D]``, k/v ``[1, Hkv, N, D]``; one record per (method, params).

    Each record: ``method``, ``params``, ``fraction`` (mean over heads [and repeats] of
    keys touched / N), ``rel_error`` (mean over heads [and repeats]), ``rel_error_heads``
    (per head), and for MagicPIG the ``predicted_fraction`` of the cost model.
    """
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    N = k.shape[2]
    Hq = q.shape[1]
    o, _ = _dense(q, k, v)
    records: list[dict] = []

    def add(method, params, frac_heads, err_heads, **extra):
        records.append(
            {
                "method": method,
                "params": params,
                "fraction": float(np.mean(frac_heads)),
                "rel_error": float(np.mean(err_heads)),
                "rel_error_heads": [float(x) for x in np.asarray(err_heads).ravel()],
                **extra,
            }
        )
        if progress is not None:
            progress.update(1)

    lengths = jnp.full((1,), N, jnp.int32)
    for f in settings.fractions:
        out, _ = _topk(q, k, v, f)
        kept = min(math.ceil(f * N), N)
        add("topk", {"budget": f}, np.full(Hq, kept / N), _rel_err(out, o))
        out, _ = _quest(q, k, v, settings.page_size, f)
        mask = _quest_mask(q, k, settings.page_size, f, lengths)
        add("quest", {"budget": f, "page_size": settings.page_size},
            np.asarray(jnp.sum(mask, -1)).reshape(-1) / N, _rel_err(out, o))
        keys = jax.random.split(jax.random.key(settings.seed), settings.repeats)
        outs, _, distinct = _oracle_many(f)(keys, q, k, v)
        errs = np.stack([_rel_err(outs[r], o) for r in range(settings.repeats)])
        add("oracle", {"budget": f, "draws": math.ceil(f * N)},
            np.asarray(distinct, np.float64)[:, 0] / N, errs.mean(0))
    for K, L in settings.lsh:
        cfg = MagicPIGConfig(K=K, L=L, num_sink=settings.num_sink, num_local=settings.num_local,
                             seed=settings.seed)
        for center in (True, False):
            errs, fracs, preds = [], [], []
            for r in range(settings.repeats):
                proj = lsh.simhash_projections(jax.random.key(settings.seed * 1000 + r), q.shape[-1], K, L)
                index = _build(k, proj, cfg, center=center)
                out, _, num = _magicpig(q, k, v, index, cfg)
                static = int(index.start[0]) + N - int(index.end[0])
                errs.append(_rel_err(out, o))
                fracs.append((np.asarray(num, np.float64)[0] + static) / N)
                if r == 0:
                    cos = np.asarray(_centered_cosines(q, k, index.mean))
                    hashed = slice(int(index.start[0]), int(index.end[0]))
                    n_hashed = hashed.stop - hashed.start
                    preds = [
                        (expected_sampled_fraction(cos[h, hashed], K, L) * n_hashed + static) / N
                        if n_hashed > 0 else static / N
                        for h in range(Hq)
                    ]
            add("magicpig", {"K": K, "L": L, "center": center, "num_sink": settings.num_sink,
                             "num_local": settings.num_local},
                np.mean(fracs, 0), np.mean(errs, 0), predicted_fraction=float(np.mean(preds)))
    return records


def _summary(records: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        key = (r["source"], r["method"], json.dumps(r["params"], sort_keys=True))
        groups.setdefault(key, []).append(r)
    out = []
    for (source, method, params), rs in groups.items():
        out.append({
            "source": source, "method": method, "params": json.loads(params), "cases": len(rs),
            "fraction": float(np.mean([r["fraction"] for r in rs])),
            "rel_error": float(np.mean([r["rel_error"] for r in rs])),
            "rel_error_median": float(np.median([r["rel_error"] for r in rs])),
        })
    return out


def _plot(summary: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise RuntimeError("the PNG needs matplotlib (pip install matplotlib), or pass --no-plot") from err
    sources = sorted({s["source"] for s in summary})
    fig, axes = plt.subplots(1, len(sources), figsize=(6.5 * len(sources), 5), squeeze=False)
    styles = {"topk": ("C0", "o-"), "quest": ("C1", "s-"), "oracle": ("C2", "^-")}
    for ax, source in zip(axes[0], sources, strict=True):
        rows = [s for s in summary if s["source"] == source]
        for method, (color, style) in styles.items():
            pts = sorted((s["fraction"], s["rel_error"]) for s in rows if s["method"] == method)
            if pts:
                ax.plot(*zip(*pts, strict=True), style, color=color, label=method, ms=4)
        for center, marker in ((True, "*"), (False, "x")):
            pts = [s for s in rows if s["method"] == "magicpig" and s["params"]["center"] == center]
            if pts:
                ax.scatter([s["fraction"] for s in pts], [s["rel_error"] for s in pts], marker=marker,
                           s=70, color="C3" if center else "C7",
                           label="MagicPIG " + ("centered" if center else "uncentered"))
                for s in pts:
                    ax.annotate(f"K{s['params']['K']}L{s['params']['L']}", (s["fraction"], s["rel_error"]),
                                fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("fraction of keys touched")
        ax.set_ylabel("relative error ||o_hat - o|| / ||o|| (mean over heads)")
        ax.set_title(f"attention estimators: {source}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="magicpig-jax study attention", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/study"), help="output directory")
    p.add_argument("--capture", type=Path, default=None,
                   help=".npz with q [layers, Hq, D], k and v [layers, Hkv, N, D]")
    p.add_argument("--capture-from-model", action="store_true",
                   help="capture q/k/v from the embedded SmolLM2 on --capture-text first (written to OUT/capture.npz)")
    p.add_argument("--capture-text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"),
                   help="real prose prefilled for --capture-from-model (default: GPL-3, 7.6K tokens)")
    p.add_argument("--no-synthetic", action="store_true", help="skip the synthetic cases")
    p.add_argument("--profiles", default=",".join(PROFILES), help=f"synthetic profiles, subset of {PROFILES}")
    p.add_argument("--n", type=int, default=4096, help="synthetic keys per head")
    p.add_argument("--head-dim", type=int, default=64, help="synthetic head dimension")
    p.add_argument("--heads", type=int, default=4, help="synthetic heads per case")
    p.add_argument("--layers", default=None, help="comma-separated capture layers (default: all)")
    p.add_argument("--fractions", type=_fractions, default=DEFAULT_FRACTIONS,
                   help="budgets of TopK / Quest / oracle sampling as fractions of the context")
    p.add_argument("--lsh", type=_pairs, default=DEFAULT_LSH, help="MagicPIG (K, L) pairs, e.g. 10x150,11x300")
    p.add_argument("--num-sink", type=int, default=4)
    p.add_argument("--num-local", type=int, default=64)
    p.add_argument("--page-size", type=int, default=16, help="Quest page size")
    p.add_argument("--repeats", type=int, default=4, help="seeds per random estimator")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-plot", action="store_true", help="write the JSON only")
    return p


def _load_capture(path: Path, layers: str | None):
    if not path.exists():
        raise FileNotFoundError(f"--capture file not found: {path}")
    with np.load(path) as z:
        missing = [name for name in ("q", "k", "v") if name not in z]
        if missing:
            raise ValueError(f"--capture {path} lacks arrays {missing} (needs q, k, v)")
        q, k, v = (np.asarray(z[name], np.float32) for name in ("q", "k", "v"))
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
    return [(f"layer{i}", q[i : i + 1], k[i : i + 1], v[i : i + 1]) for i in idx]


def main(argv: list[str] | None = None) -> int:
    """Run the study; returns 0 (writes ``study.json`` and ``study.png`` into ``--out``).

    Raises:
      ValueError: bad arguments or a malformed capture (the CLI reports it and exits 2).
      FileNotFoundError: ``--capture`` does not exist.
    """
    args = make_parser().parse_args(argv)
    profiles = [p.strip() for p in args.profiles.split(",") if p.strip()]
    bad = [p for p in profiles if p not in PROFILES]
    if bad:
        raise ValueError(f"--profiles: unknown {bad}; choose from {PROFILES}")
    for K, L in args.lsh:
        lsh.validate_k_l(K, L)
    settings = StudySettings(fractions=args.fractions, lsh=args.lsh, num_sink=args.num_sink,
                             num_local=args.num_local, page_size=args.page_size, repeats=args.repeats,
                             seed=args.seed)
    MagicPIGConfig(num_sink=args.num_sink, num_local=args.num_local, seed=args.seed)  # validates
    if args.repeats < 1 or args.page_size < 1:
        raise ValueError("--repeats and --page-size must be >= 1")
    cases = []
    if not args.no_synthetic:
        rng = np.random.default_rng(args.seed)
        for profile in profiles:
            cases.append(("synthetic", profile, *synthetic_case(rng, profile, args.n, args.head_dim, args.heads)))
    if args.capture_from_model:
        if args.capture is not None:
            raise ValueError("--capture-from-model and --capture are exclusive")
        from magicpig_jax.eval.capture import capture_qkv
        from magicpig_jax.io.loader import load_model

        if not args.capture_text.is_file():
            raise FileNotFoundError(f"--capture-text {args.capture_text} does not exist")
        data = capture_qkv(load_model(), args.capture_text.read_text(encoding="utf-8"))
        args.out.mkdir(parents=True, exist_ok=True)
        args.capture = args.out / "capture.npz"
        np.savez(args.capture, **data)
    if args.capture is not None:
        cases += [("capture", name, q, k, v) for name, q, k, v in _load_capture(args.capture, args.layers)]
    if not cases:
        raise ValueError("nothing to study: --no-synthetic without --capture")
    per_case = 3 * len(settings.fractions) + 2 * len(settings.lsh)
    records: list[dict] = []
    t0 = time.perf_counter()
    with tqdm(total=per_case * len(cases), desc="study attention", unit="run") as bar:
        for source, name, q, k, v in cases:
            bar.set_postfix_str(f"{source}:{name}")
            for r in run_case(q, k, v, settings, bar):
                records.append({"source": source, "case": name, "N": int(k.shape[2]), **r})
    summary = _summary(records)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "settings": dataclasses.asdict(settings) | {"capture": str(args.capture) if args.capture else None},
        "seconds": time.perf_counter() - t0,
        "summary": summary,
        "records": records,
    }
    (args.out / "study.json").write_text(json.dumps(result, indent=1))
    if not args.no_plot:
        _plot(summary, args.out / "study.png")
    print(f"wrote {args.out / 'study.json'}" + ("" if args.no_plot else f" and {args.out / 'study.png'}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
