"""The A/B of 3acadbe (the candidates loop in 8 lanes): the op alone, 28 layers per call; see op_rounds.json.

(Reformatted for ruff after the run; the computation is the one that was timed.)
"""
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from magicpig_jax import lsh
from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.host import host_build_index
from magicpig_jax.host.attention import host_magicpig_attention

B, Hq, Hkv, D = 1, 9, 3, 64


def timed(f, *a, n=300):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    return round(1e3 * float(np.median(ts)), 3)


res = {}
cfg = MagicPIGConfig()
for Bx in (1, 16):
    for N in (1024, 8192):
        rng = np.random.default_rng(0)
        k = jnp.asarray(rng.standard_normal((Bx, Hkv, N + 64, D)), jnp.bfloat16)
        v = jnp.asarray(rng.standard_normal((Bx, Hkv, N + 64, D)), jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((Bx, Hq, D)), jnp.float32)
        lengths = jnp.full((Bx,), N, jnp.int32)
        proj = lsh.simhash_projections(jax.random.key(0), D, cfg.K, cfg.L)
        # the decoder's layout: hashed [sinks, N - static window), the tail exact in the op
        idx = host_build_index(k, proj, cfg, lengths - cfg.static_window(), capacity=N + 64)
        fm = jax.jit(lambda q, k, v, idx, lengths: [
            host_magicpig_attention(q + i, k, v, idx, cfg, lengths, static_window=0) for i in range(28)])
        res[f"B{Bx}_N{N}"] = timed(fm, q, k, v, idx, lengths, n=300 if Bx == 1 else 30)
print(json.dumps(res), flush=True)
