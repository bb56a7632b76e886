"""The measurement of the attention study: synthetic cases and every estimator on one case.

:func:`synthetic_case` builds q/k/v whose logits follow a chosen long-tailed profile with
keys in a cone roughly opposite the query (arXiv 2410.16179, Section 4.2, Fig. 6);
:func:`run_case` runs TopK, Quest, oracle sampling (Definition 3.1), MagicPIG and the hybrid
estimator (:mod:`magicpig_jax.attention.hybrid`: keys colliding in >= ``heavy`` tables kept
exactly, the rest weighted by ``1/u_c``; same sampled set as MagicPIG) on one case and
measures the relative error ``||o_hat - o|| / ||o||`` against dense attention and
the fraction of keys touched. The command line is :mod:`magicpig_jax.eval.study`.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from magicpig_jax import lsh
from magicpig_jax.attention import (
    HybridConfig,
    MagicPIGConfig,
    build_lsh_index,
    dense_attention,
    hybrid_attention,
    magicpig_attention,
    oracle_sampling_attention,
    quest_attention,
    topk_attention,
)
from magicpig_jax.attention._common import check_softcap
from magicpig_jax.attention.baselines import Budget, budget_tokens, quest_mask
from magicpig_jax.attention.cost_model import expected_sampled_fraction

__all__ = [
    "PROFILES",
    "DEFAULT_FRACTIONS",
    "DEFAULT_LSH",
    "StudySettings",
    "synthetic_case",
    "run_case",
    "summarize",
]

PROFILES = ("gauss1", "gauss2", "gauss3", "zipf", "heavy_hitters")
DEFAULT_FRACTIONS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2)
DEFAULT_LSH = ((8, 60), (9, 100), (10, 150), (10, 170), (11, 300))
DEFAULT_HEAVY = (4, 8)


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
    """What :func:`run_case` runs: budgets (fractions of the context) of TopK/Quest/oracle,
    MagicPIG ``(K, L)`` pairs, the static set, the Quest page size, seeds per random estimator."""

    fractions: tuple[float, ...] = DEFAULT_FRACTIONS
    lsh: tuple[tuple[int, int], ...] = DEFAULT_LSH
    num_sink: int = 4
    num_local: int = 64
    page_size: int = 16
    repeats: int = 4
    seed: int = 0
    heavy: tuple[int, ...] = DEFAULT_HEAVY


def _rel_err(est, ref) -> np.ndarray:
    """``||est - ref|| / ||ref||`` per (row, head): float64 ``[Hq]`` of row 0."""
    est, ref = np.asarray(est, np.float64)[0], np.asarray(ref, np.float64)[0]
    return np.linalg.norm(est - ref, axis=-1) / np.maximum(np.linalg.norm(ref, axis=-1), 1e-30)


_dense = jax.jit(dense_attention, static_argnames="softcap")
_topk = jax.jit(topk_attention, static_argnames=("budget", "softcap"))
_quest = jax.jit(quest_attention, static_argnames=("page_size", "budget", "softcap"))
_quest_mask = jax.jit(quest_mask, static_argnames=("page_size", "budget"))
_build = jax.jit(build_lsh_index, static_argnames=("config", "center"))
_magicpig = jax.jit(magicpig_attention, static_argnames=("config", "softcap"))
_hybrid = jax.jit(hybrid_attention, static_argnames=("config", "softcap"))


@jax.jit
def _centered_cosines(q, k, mean):
    """cos(q_h, k_i - mean) for every head and key: ``[Hq, N]`` (row 0)."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    kc = lsh.exponent_scaled((k - mean[:, :, None, :])[0])  # [Hkv, N, D]
    qg = lsh.exponent_scaled(q[0].reshape(Hkv, Hq // Hkv, D))
    dots = jnp.einsum("hgd,hnd->hgn", qg, kc, precision=jax.lax.Precision.HIGHEST)
    return lsh.cosine_from_dots(dots, qg[..., None, :], kc[:, None, :, :]).reshape(Hq, -1)


def _oracle_many(budget: Budget, softcap: float | None):
    def f(keys, q, k, v):
        return jax.vmap(lambda r: oracle_sampling_attention(r, q, k, v, budget, softcap=softcap))(keys)

    return jax.jit(f)


def _baseline_records(q, k, v, o, settings: StudySettings, add, softcap: float | None) -> None:
    """TopK, Quest and oracle sampling at each fraction of :attr:`StudySettings.fractions`."""
    N, Hq = k.shape[2], q.shape[1]
    lengths = jnp.full((1,), N, jnp.int32)
    for f in settings.fractions:
        out, _ = _topk(q, k, v, f, softcap=softcap)
        # the keys the baselines' own budget rule gives (ceil(f N) in float32 could round 7.000000000000001 up)
        kept = draws = int(budget_tokens(f, lengths)[0])
        add("topk", {"budget": f}, np.full(Hq, kept / N), _rel_err(out, o))
        out, _ = _quest(q, k, v, settings.page_size, f, softcap=softcap)
        mask = _quest_mask(q, k, settings.page_size, f, lengths)
        add("quest", {"budget": f, "page_size": settings.page_size},
            np.asarray(jnp.sum(mask, -1)).reshape(-1) / N, _rel_err(out, o))
        keys = jax.random.split(jax.random.key(settings.seed), settings.repeats)
        outs, _, distinct = _oracle_many(f, softcap)(keys, q, k, v)
        errs = np.stack([_rel_err(outs[r], o) for r in range(settings.repeats)])
        add("oracle", {"budget": f, "draws": draws},
            np.asarray(distinct, np.float64)[:, 0] / N, errs.mean(0))


def run_case(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, settings: StudySettings, progress: tqdm | None = None,
    *, softcap: float | None = None,
) -> list[dict]:
    """Every estimator on one case: q ``[1, Hq, D]``, k/v ``[1, Hkv, N, D]``; one record per (method, params).

    ``softcap``: the attention logit soft-capping c of the model the case was captured from
    (Gemma 2; None for none): the dense reference and every estimator cap their logits with it.

    Each record: ``method``, ``params``, ``fraction`` (mean over heads [and repeats] of
    keys touched / N), ``rel_error`` (mean over heads [and repeats]), ``rel_error_heads``
    (per head), and for MagicPIG the ``predicted_fraction`` of the cost model.
    """
    q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    N = k.shape[2]
    Hq = q.shape[1]
    softcap = check_softcap(softcap)
    o, _ = _dense(q, k, v, softcap=softcap)
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

    _baseline_records(q, k, v, o, settings, add, softcap)
    for K, L in settings.lsh:
        cfg = MagicPIGConfig(K=K, L=L, num_sink=settings.num_sink, num_local=settings.num_local,
                             seed=settings.seed)
        for center in (True, False):
            errs, fracs, preds = [], [], []
            for r in range(settings.repeats):
                proj = lsh.simhash_projections(jax.random.key(settings.seed * 1000 + r), q.shape[-1], K, L)
                index = _build(k, proj, cfg, center=center)
                out, _, num = _magicpig(q, k, v, index, cfg, softcap=softcap)
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
        for heavy in (m for m in settings.heavy if 3 <= m <= L + 1):
            hcfg = HybridConfig(K=K, L=L, heavy=heavy, num_sink=settings.num_sink, num_local=settings.num_local,
                                seed=settings.seed)
            errs, fracs = [], []
            for r in range(settings.repeats):  # the same projections as MagicPIG's repeats: the same sampled sets
                proj = lsh.simhash_projections(jax.random.key(settings.seed * 1000 + r), q.shape[-1], K, L)
                index = _build(k, proj, cfg, center=True)
                out, _, num = _hybrid(q, k, v, index, hcfg, softcap=softcap)
                static = int(index.start[0]) + N - int(index.end[0])
                errs.append(_rel_err(out, o))
                fracs.append((np.asarray(num, np.float64)[0] + static) / N)
            add("hybrid", {"K": K, "L": L, "heavy": heavy, "num_sink": settings.num_sink,
                           "num_local": settings.num_local}, np.mean(fracs, 0), np.mean(errs, 0))
    return records


def summarize(records: list[dict]) -> list[dict]:
    """One row per (source, method, params): the number of cases and the mean fraction and error.

    Args:
      records: :func:`run_case` records, each with a ``source`` added.

    Returns:
      dicts with ``source``, ``method``, ``params``, ``cases``, ``fraction`` (mean),
      ``rel_error`` (mean) and ``rel_error_median``.
    """
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
