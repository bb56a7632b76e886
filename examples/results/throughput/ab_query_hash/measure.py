"""Query SimHash codes of one decode step over 28 layers: XLA's dot (lsh.simhash_codes) vs the host
kernel (magicpig_jax.host.simhash.host_simhash_codes), B * Hq = 9 and 144 rows (SmolLM2 at B = 1, 16).

Run: python examples/results/throughput/ab_query_hash/measure.py OUT.json
Rounds alternate the two implementations in one process; each round is the median of 30 calls.
"""
import json
import os
import platform
import sys
import time

import jax
import numpy as np

from magicpig_jax import lsh
from magicpig_jax.host.simhash import host_simhash_codes

LAYERS, D, ROUNDS, CALLS = 28, 64, 5, 30
out = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__},
       "layers": LAYERS, "D": D, "rounds": ROUNDS, "calls_per_round": CALLS,
       "start": time.strftime("%FT%TZ", time.gmtime()),
       "results": []}


def all_layers(codes, K, L):
    """One jitted call hashing the query with every layer's hyperplanes."""
    return jax.jit(lambda q, ps: [codes(q + i, p, K, L) for i, p in enumerate(ps)])


for K, L in ((10, 150), (11, 450), (12, 900)):
    projs = [lsh.simhash_projections(jax.random.key(i), D, K, L) for i in range(LAYERS)]
    for M in (9, 144):  # B * Hq at B = 1 and B = 16 (SmolLM2: Hq = 9)
        q = jax.random.normal(jax.random.key(99), (M, D))
        fx, fh = all_layers(lsh.simhash_codes, K, L), all_layers(host_simhash_codes, K, L)
        mism = int(sum((np.asarray(a) != np.asarray(b)).sum() for a, b in zip(fx(q, projs), fh(q, projs), strict=True)))
        rounds = {"xla": [], "host": []}
        for _ in range(ROUNDS):
            for name, f in (("xla", fx), ("host", fh)):
                jax.block_until_ready(f(q, projs))
                ts = []
                for _ in range(CALLS):
                    t = time.perf_counter()
                    jax.block_until_ready(f(q, projs))
                    ts.append(time.perf_counter() - t)
                rounds[name].append(1e3 * float(np.median(ts)))
        rec = {"K": K, "L": L, "M": M, "projection_MB_per_step": LAYERS * D * K * L * 4 / 1e6,
               "codes_differing": mism}
        for name, v in rounds.items():
            rec[name + "_ms_rounds"] = v
            rec[name + "_ms_median"] = float(np.median(v))
        out["results"].append(rec)
        print(rec, flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
