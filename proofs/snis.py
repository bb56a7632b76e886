"""Check proofs/snis.md: self-normalized importance sampling is consistent with bias beta/B + o(1/B)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction as F

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


def inclusion_checks() -> None:
    """MagicPIG-style independent inclusions J_i ~ Bernoulli(u_i), one static key always included."""
    w_tilde = [F(8), F(5), F(3), F(2), F(1), F(1), F(1, 2), F(1, 4)]
    vals = [F(2), F(-1), F(3), F(0), F(-4), F(1), F(5), F(-3)]
    a = [F(1, 3), F(1, 4), F(1, 5), F(1, 6), F(1, 8), F(1, 8), F(1, 10), F(1, 10)]
    static_w, static_v = F(2), F(1)
    Z = sum(w_tilde) + static_w
    o = (sum(w * v for w, v in zip(w_tilde, vals, strict=True)) + static_w * static_v) / Z
    prev_bias, prev_mse = None, None
    for t in (1, 2, 4, 8, 16):
        u = [1 - (1 - ai) ** t for ai in a]
        e_num, e_den, bias, mse = F(0), F(0), F(0), F(0)
        for J in itertools.product((0, 1), repeat=len(u)):
            prob = math.prod((ui if j else 1 - ui for ui, j in zip(u, J, strict=True)), start=F(1))
            num = sum(j * w / ui * v for j, w, ui, v in zip(J, w_tilde, u, vals, strict=True))
            den = sum(j * w / ui for j, w, ui in zip(J, w_tilde, u, strict=True))
            if PERTURB:  # the sums without the inverse inclusion probabilities
                e_num += prob * sum(j * w * v for j, w, v in zip(J, w_tilde, vals, strict=True))
                e_den += prob * sum(j * w for j, w in zip(J, w_tilde, strict=True))
            else:
                e_num += prob * num
                e_den += prob * den
            err = (num + static_w * static_v) / (den + static_w) - o
            bias += prob * err
            mse += prob * err * err
        check(e_num == sum(w * v for w, v in zip(w_tilde, vals, strict=True)), f"HT numerator biased, t={t}")
        check(e_den == sum(w_tilde), f"HT denominator biased, t={t}")
        if prev_bias is not None:  # --perturb: claimed increasing
            check((abs(bias) > abs(prev_bias)) if PERTURB else (abs(bias) < abs(prev_bias)),
                  f"inclusion bias not decreasing at t={t}")
            check((mse > prev_mse) if PERTURB else (mse < prev_mse), f"inclusion MSE not decreasing at t={t}")
        print(f"inclusions t={t}: bias {float(bias):+.5f}, t * MSE {float(t * mse):.4f}")
        scaled = t * t * mse if PERTURB else t * mse  # --perturb: MSE ~ 1 / t^2
        check(float(scaled) < 3.0, f"t * MSE = {float(t * mse)} not bounded at t={t}")
        prev_bias, prev_mse = bias, mse


def main() -> None:
    iid_checks()
    inclusion_checks()
    finish("snis")


if __name__ == "__main__":
    main()
