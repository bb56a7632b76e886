"""Query SimHash codes of one decode step over 28 layers with the host kernel: every layer its own
projection matrix, against one matrix passed to all 28 (MagicPIGConfig.layers_per_projection).

Run: python examples/results/throughput/ab_shared_projections/measure.py OUT.json
B * Hq = 9 and 144 rows (SmolLM2 at B = 1, 16); rounds alternate the two in one process, each
round the median of 30 calls of the jitted 28-layer program.
"""

import json
import sys
import time

import jax
import numpy as np

from magicpig_jax import lsh
from magicpig_jax.host.simhash import host_simhash_codes

LAYERS, D, ROUNDS, CALLS = 28, 64, 5, 30


def all_layers(K, L):
    """One jitted call hashing the query with every layer's matrix (the list passed in)."""
    return jax.jit(lambda q, ps: [host_simhash_codes(q + i, p, K, L) for i, p in enumerate(ps)])


def timed(f, *args):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(CALLS):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t)
    return 1e3 * float(np.median(ts))


res = []
for K, L in ((10, 150), (11, 450), (12, 900)):
    own = [lsh.simhash_projections(jax.random.key(i), D, K, L) for i in range(LAYERS)]
    shared = [own[0]] * LAYERS  # one buffer, passed 28 times
    for M in (9, 144):  # B * Hq at B = 1 and B = 16 (SmolLM2: Hq = 9)
        q = jax.random.normal(jax.random.key(99), (M, D))
        f = all_layers(K, L)
        r = {"distinct": [], "shared": []}
        for _ in range(ROUNDS):
            for name, ps in (("distinct", own), ("shared", shared)):
                r[name].append(timed(f, q, ps))
        rec = {"K": K, "L": L, "M": M, **{k + "_ms": [round(x, 3) for x in v] for k, v in r.items()},
               **{k + "_median": round(float(np.median(v)), 3) for k, v in r.items()}}
        print(rec, flush=True)
        res.append(rec)
with open(sys.argv[1], "w") as fh:
    json.dump(res, fh, indent=1)
