"""Independent float64 NumPy references of the attention estimators (test helper).

Written from the paper's definitions with plain loops over (row, query head),
sharing no code with ``magicpig_jax``. Shapes: q ``[B, Hq, D]``, k/v
``[B, Hkv, N, D]``; query head h reads KV head ``h // (Hq // Hkv)``.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

LOG_U_FLOOR = math.log(1e-30)


def softmax_over(logits: np.ndarray, mask: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, float]:
    """Float64 softmax attention over ``logits[mask]``; empty -> (0, -inf)."""
    if not mask.any():
        return np.zeros(v.shape[-1]), -math.inf
    x = logits[mask]
    m = x.max()
    e = np.exp(x - m)
    return e @ v[mask] / e.sum(), float(m + math.log(e.sum()))


def _f64(*xs):
    return [np.asarray(x, dtype=np.float64) for x in xs]


def dense(q, k, v, lengths=None):
    """Exact attention; returns (out [B, Hq, D], lse [B, Hq]) in float64."""
    q, k, v = _f64(q, k, v)
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    lengths = np.full(B, N) if lengths is None else np.clip(np.asarray(lengths), 0, N)
    out, lse = np.zeros((B, Hq, D)), np.zeros((B, Hq))
    for b in range(B):
        for h in range(Hq):
            logits = k[b, h // G] @ q[b, h] / math.sqrt(D)
            mask = np.arange(N) < lengths[b]
            out[b, h], lse[b, h] = softmax_over(logits, mask, v[b, h // G])
    return out, lse


def softcap(logits: np.ndarray, c: float | None) -> np.ndarray:
    """Gemma 2's attention logit soft-capping ``c tanh(s / c)`` of the finite logits (identity for
    None); a non-finite logit is left as it is, as the implementation leaves it."""
    if c is None:
        return logits
    with np.errstate(invalid="ignore"):
        return np.where(np.isfinite(logits), c * np.tanh(logits / c), logits)


def selected(q, k, v, keep, cap=None):
    """Exact attention over ``keep`` bool ``[B, Hq, N]`` (logits soft-capped by ``cap``, None for
    none); returns (out, lse) float64."""
    q, k, v = _f64(q, k, v)
    B, Hq, D = q.shape
    G = Hq // k.shape[1]
    out, lse = np.zeros((B, Hq, D)), np.zeros((B, Hq))
    for b in range(B):
        for h in range(Hq):
            logits = softcap(k[b, h // G] @ q[b, h] / math.sqrt(D), cap)
            out[b, h], lse[b, h] = softmax_over(logits, keep[b, h], v[b, h // G])
    return out, lse


def topk_keep(q, k, tokens, lengths):
    """Bool ``[B, Hq, N]``: the ``min(tokens[b], lengths[b])`` largest logits (ties by index)."""
    q, k = _f64(q, k)
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    keep = np.zeros((B, Hq, N), bool)
    for b in range(B):
        n = int(lengths[b])
        for h in range(Hq):
            logits = k[b, h // G, :n] @ q[b, h]
            order = sorted(range(n), key=lambda i: (-logits[i], i))
            keep[b, h, order[: min(int(tokens[b]), n)]] = True
    return keep


def quest_keep(q, k, page_size, tokens, lengths):
    """Bool ``[B, Hq, N]``: Quest's pages by the min/max upper bound (see quest_attention's doc)."""
    q, k = _f64(q, k)
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    keep = np.zeros((B, Hq, N), bool)
    for b in range(B):
        n = int(lengths[b])
        if n == 0:
            continue
        n_pages = -(-n // page_size)
        t = min(int(tokens[b]), n)
        n_keep = n_pages if t >= n else max(1, t // page_size)
        for h in range(Hq):
            scores = []
            for j in range(n_pages):
                kp = k[b, h // G, j * page_size : min((j + 1) * page_size, n)]
                lo, hi = kp.min(0), kp.max(0)
                scores.append(np.sum(np.maximum(q[b, h] * lo, q[b, h] * hi)))
            order = sorted(range(n_pages), key=lambda j: (-scores[j], j))
            for j in order[:n_keep]:
                keep[b, h, j * page_size : min((j + 1) * page_size, n)] = True
    return keep


def u_exact(p, K, L):
    """P[Binomial(L, p^K) >= 2] in float64."""
    return stats.binom.sf(1, L, np.asarray(p, np.float64) ** K)


def magicpig(q, k, v, key_codes, query_codes, K, L, num_sink, num_local, build_lengths, lengths, center=True):
    """Float64 MagicPIG estimator given the hash codes (arXiv 2410.16179, Eq. (4), (9)).

    key_codes ``[B, Hkv, N, L]`` (the index's), query_codes ``[B, Hq, L]``. The
    hashed range of row b is ``[min(num_sink, n0), max(n0 - num_local, start))``
    with ``n0 = build_lengths[b]``; keys there are centered by their mean and
    sampled when >= 2 tables collide, with logit ``q·k/sqrt(D) - max(log u, log 1e-30)``;
    every other key ``< lengths[b]`` is exact; ``center=False``: the mean is 0.
    Returns (out, lse, num_sampled).
    """
    q, k, v = _f64(q, k, v)
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    out, lse = np.zeros((B, Hq, D)), np.zeros((B, Hq))
    num = np.zeros((B, Hq), np.int64)
    for b in range(B):
        n0, n = int(build_lengths[b]), int(lengths[b])
        start = min(num_sink, n0)
        end = max(n0 - num_local, start)
        for h in range(Hq):
            kh, vh = k[b, h // G], v[b, h // G]
            mean = kh[start:end].mean(0) if end > start and center else np.zeros(D)
            logits = kh @ q[b, h] / math.sqrt(D)
            mask = np.zeros(N, bool)
            for i in range(n):
                if start <= i < end:
                    hits = int(np.sum(key_codes[b, h // G, i] == query_codes[b, h]))
                    if hits >= 2:
                        kc = kh[i] - mean
                        nq, nk = np.linalg.norm(q[b, h]), np.linalg.norm(kc)
                        cos = q[b, h] @ kc / (nq * nk) if nq * nk > 0 else 0.0
                        p = 1 - math.acos(min(1.0, max(-1.0, cos))) / math.pi
                        u = float(u_exact(p, K, L))
                        log_u = max(math.log(u), LOG_U_FLOOR) if u > 0 else LOG_U_FLOOR
                        logits[i] -= log_u
                        mask[i] = True
                        num[b, h] += 1
                else:
                    mask[i] = True
            out[b, h], lse[b, h] = softmax_over(logits, mask, vh)
    return out, lse, num
