"""Check proofs/snis.md: self-normalized importance sampling is consistent with bias beta/B + o(1/B)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction as F

import numpy as np
from _check import PERTURB, check, finish

# Three keys, rational unnormalized weights, a proposal far from the target, 1-D values.
W_TILDE = [F(6), F(3), F(1)]
PROPOSAL = [F(1, 5), F(2, 5), F(2, 5)]
VALUES = [F(1), F(-2), F(4)]


def target():
    Z = sum(W_TILDE)
    o = sum(w * v for w, v in zip(W_TILDE, VALUES, strict=True)) / Z
    return Z, o


def exact_moments(pi, B, tol=1):
    """Exact E[X_B - o], E[(X_B - o)^2] and P(|X_B - o| > tol) by enumerating count vectors."""
    Z, o = target()
    rho = [w / p for w, p in zip(W_TILDE, pi, strict=True)]
    n = len(pi)
    bias, mse, tail = F(0), F(0), F(0)
    for cuts in itertools.combinations(range(B + n - 1), n - 1):
        counts = [b - a - 1 for a, b in itertools.pairwise((-1, *cuts, B + n - 1))]
        coef = math.factorial(B)
        for c in counts:
            coef //= math.factorial(c)
        prob = coef * math.prod((p**c for p, c in zip(pi, counts, strict=True)), start=F(1))
        num = sum(c * r * v for c, r, v in zip(counts, rho, VALUES, strict=True))
        den = sum(c * r for c, r in zip(counts, rho, strict=True))
        err = num / den - o
        bias += prob * err
        mse += prob * err * err
        if abs(err) > tol:
            tail += prob
    return bias, mse, tail


def iid_checks() -> None:
    Z, o = target()
    rho = [w / p for w, p in zip(W_TILDE, PROPOSAL, strict=True)]
    beta = -sum(p * r * r * (v - o) for p, r, v in zip(PROPOSAL, rho, VALUES, strict=True)) / Z**2
    sigma2 = sum(p * r * r * (v - o) ** 2 for p, r, v in zip(PROPOSAL, rho, VALUES, strict=True)) / Z**2
    if PERTURB:
        beta = -beta
    exact_pi = [w / Z for w in W_TILDE]  # the proposal equal to the target
    bias1, _, _ = exact_moments(PROPOSAL, 1)
    # --perturb: X_1 claimed unbiased
    claimed = 0 if PERTURB else sum(p * v for p, v in zip(PROPOSAL, VALUES, strict=True)) - o
    check(bias1 == claimed, "E[X_1] != sum pi_i v_i")
    # --perturb: the biased example replaced by the proposal equal to the target
    check(exact_moments(exact_pi if PERTURB else PROPOSAL, 1)[0] != 0, "the example must be biased at B = 1")
    gaps, tails = {}, {}
    for B in (1, 2, 4, 8, 16, 32, 64):
        # --perturb: the tail at |X_B - o| > 0.01, which B = 64 does not yet make small
        bias, mse, tail = exact_moments(PROPOSAL, B, F(1, 100) if PERTURB else 1)
        gaps[B] = abs(B * bias - beta)
        tails[B] = tail
        if B == 64:
            scale = B * B if PERTURB else B  # --perturb: MSE ~ sigma^2 / B^2
            check(abs(float(scale * mse / sigma2) - 1) < 0.1,
                  f"B * MSE = {float(B * mse)} vs sigma^2 = {float(sigma2)}")
    check(float(gaps[64]) <= 0.6 * float(gaps[32]), f"|B bias - beta|: {float(gaps[32])} -> {float(gaps[64])}")
    check(float(gaps[64]) < 0.05 * abs(float(beta)), f"B*bias at B=64 is not close to beta={float(beta)}")
    tail_list = [tails[B] for B in (4, 8, 16, 32, 64)]
    check(
        float(tails[64]) < 1e-2 and all(a > b for a, b in itertools.pairwise(tail_list)),
        f"tail probabilities {list(map(float, tails.values()))}",
    )
    # Proposal = target: rho = Z is constant and X_B is oracle sampling (Theorem 3.2):
    # beta = 0, the bias is exactly 0 and the MSE exactly Var_w(v) / B.
    var_w = sum(p * (v - o) ** 2 for p, v in zip(exact_pi, VALUES, strict=True))
    for B in (1, 3, 10):
        bias, mse, _ = exact_moments(exact_pi, B)
        scale = B * B if PERTURB else B  # --perturb: MSE Var / B^2
        check(bias == 0 and mse == var_w / scale, f"proposal = target must be unbiased with MSE Var/B at B={B}")


def angle(x, y) -> float:
    c = float(x @ y / (np.linalg.norm(x) * np.linalg.norm(y)))
    return math.acos(min(1.0, max(-1.0, c)))


def binom_u(P: float, L: int) -> float:
    """P[Binomial(L, P) >= 2] in float64."""
    return 1.0 - (1.0 - P) ** L - L * P * (1.0 - P) ** (L - 1)


def joint_inclusion(q, ki, kj, K: int, L: int) -> float:
    """pi_ij = P[C_i >= 2 and C_j >= 2] by the closed form of snis.md (perturbed: u_i u_j)."""
    t_qi, t_qj, t_ij = angle(q, ki), angle(q, kj), angle(ki, kj)
    pi_, pj_ = 1 - t_qi / math.pi, 1 - t_qj / math.pi
    ui, uj = binom_u(pi_**K, L), binom_u(pj_**K, L)
    if PERTURB:  # the inclusions taken as independent
        return ui * uj
    S = (1 - (t_qi + t_qj + t_ij) / (2 * math.pi)) ** K
    Ai, Aj = pi_**K - S, pj_**K - S
    N0 = 1 - pi_**K - pj_**K + S
    both_below = N0**L + L * (Ai + Aj + S) * N0 ** (L - 1) + L * (L - 1) * Ai * Aj * N0 ** (L - 2)
    return ui + uj - 1 + both_below


def dependent_inclusion_checks() -> None:
    """MagicPIG's own sampler over many draws of the hyperplanes: marginals u_i, joint inclusions pi_ij,
    the unbiased Horvitz-Thompson sum and its variance with covariance terms, and the error falling in L."""
    import jax
    import jax.numpy as jnp

    from magicpig_jax import lsh
    from magicpig_jax.attention import MagicPIGConfig, build_lsh_index
    from magicpig_jax.attention.magicpig import sampled_mask_and_log_u

    rng = np.random.default_rng(5)
    d, half, K, L, R = 8, 20, 3, 12, 4000
    base = rng.normal(size=(half, d))
    keys = np.concatenate([base, base + 0.02 * rng.normal(size=(half, d))])  # key i + half ~ key i
    n = len(keys)
    q = rng.normal(size=d) + 0.8 * base[:4].mean(0)
    logits = keys @ q / math.sqrt(d)
    a = np.exp(logits - logits.max())  # the weights of the Horvitz-Thompson denominator
    vals = rng.normal(size=n)
    static_w, static_v = 0.5, 1.0
    o = (a @ vals + static_w * static_v) / (a.sum() + static_w)

    def draws(L_: int, count: int, seed: int):
        cfg = MagicPIGConfig(K=K, L=L_, num_sink=0, num_local=0)
        k4 = jnp.asarray(keys[None, None], jnp.float32)
        q3 = jnp.asarray(q[None, None], jnp.float32)

        def one(key):
            proj = lsh.simhash_projections(key, d, K, L_)
            index = build_lsh_index(k4, proj, cfg, center=False)
            sampled, _, log_u = sampled_mask_and_log_u(q3, k4, index, cfg, jnp.asarray([n], jnp.int32))
            return sampled[0, 0, 0], log_u[0, 0, 0]

        keys_r = jax.random.split(jax.random.key(seed), count)
        J, log_u = jax.jit(jax.vmap(one))(keys_r)
        return np.asarray(J, np.float64), np.exp(np.asarray(log_u[0], np.float64))

    J, u = draws(L, R, 0)
    # marginals: the library's u against the inclusion frequencies (--perturb: one table's P = p^K)
    p = np.array([1 - angle(q, k) / math.pi for k in keys])
    u_claim = p**K if PERTURB else u
    # --perturb: u claimed as P[at least one table] = 1 - (1 - p^K)^L
    u_rule = [1 - (1 - x**K) ** L if PERTURB else binom_u(x**K, L) for x in p]
    check(np.allclose(u, u_rule, rtol=1e-4), "the library's u is not P[Bin(L, p^K) >= 2]")
    se = np.sqrt(u_claim * (1 - u_claim) / R) + 1e-12
    check(bool(np.all(np.abs(J.mean(0) - u_claim) <= 5 * se)), "inclusion frequencies differ from u")
    # joint inclusions: near-duplicate pairs and unrelated pairs
    worst = 0.0
    for i, j in [(i, i + half) for i in range(half)] + [(i, (i + 7) % half) for i in range(half)]:
        pij = joint_inclusion(q, keys[i], keys[j], K, L)
        freq = float((J[:, i] * J[:, j]).mean())
        worst = max(worst, abs(freq - pij) / (math.sqrt(pij * (1 - pij) / R) + 1e-12))
    check(worst <= 5, f"joint inclusion frequency off by {worst:.1f} standard errors")
    # one hyperplane: three vectors on one side with s = 1 - (t_qi + t_qj + t_ij) / (2 pi) (--perturb: p_i p_j)
    h = rng.normal(size=(200_000, d))
    worst = 0.0
    for i, j in ((0, half), (1, 5), (2, half + 2)):
        same = (np.sign(h @ q) == np.sign(h @ keys[i])) & (np.sign(h @ q) == np.sign(h @ keys[j]))
        t_qi, t_qj, t_ij = angle(q, keys[i]), angle(q, keys[j]), angle(keys[i], keys[j])
        s = (1 - t_qi / math.pi) * (1 - t_qj / math.pi) if PERTURB else 1 - (t_qi + t_qj + t_ij) / (2 * math.pi)
        worst = max(worst, abs(same.mean() - s) / math.sqrt(s * (1 - s) / len(h)))
    check(worst <= 5, f"three-vector one-side probability off by {worst:.1f} standard errors")
    # the Horvitz-Thompson denominator: unbiased (--perturb: without 1/u), its variance with covariances
    T = J @ (a if PERTURB else a / u)
    check(abs(T.mean() - a.sum()) <= 5 * T.std(ddof=1) / math.sqrt(R), "HT sum biased")
    Pi = np.array([[u[i] if i == j else joint_inclusion(q, keys[i], keys[j], K, L) for j in range(n)]
                   for i in range(n)]) if not PERTURB else np.diag(u) + np.outer(u, u) * (1 - np.eye(n))
    # --perturb: Pi of independent inclusions, which leaves the diagonal sum a_i^2 (1 - u_i) / u_i
    var_claim = float(a @ ((Pi / np.outer(u, u) - 1) @ a))
    T = J @ (a / u)
    dev2 = (T - T.mean()) ** 2
    var_se = dev2.std(ddof=1) / math.sqrt(R)
    diag = float(np.sum(a**2 * (1 - u) / u))
    print(f"HT variance: measured {dev2.mean():.4f}, with covariances {var_claim:.4f}, diagonal alone {diag:.4f}")
    check(abs(dev2.mean() - var_claim) <= 5 * var_se, f"HT variance {dev2.mean():.4f} vs {var_claim:.4f}")
    # the ratio with a static key: its mean squared error falls as L grows (--perturb: claimed to grow)
    mses = []
    for L_ in (4, 16, 64):
        J_, u_ = draws(L_, 1500, L_)
        num = J_ @ (a / u_ * vals) + static_w * static_v
        den = J_ @ (a / u_) + static_w
        mses.append(float(np.mean((num / den - o) ** 2)))
    print(f"ratio MSE at L = 4, 16, 64: {mses}")
    check(all((x < y) if PERTURB else (x > y) for x, y in itertools.pairwise(mses)), f"MSE in L: {mses}")


def main() -> None:
    iid_checks()
    dependent_inclusion_checks()
    finish("snis")


if __name__ == "__main__":
    main()
