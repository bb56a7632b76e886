"""Time the host ops on synthetic keys: ``python tools/time_host_ops_synthetic.py N``.

One process, one line of JSON: the median ms of 15 warm calls of the MagicPIG, exact and TopK
(5% budget) host ops and of 5 index builds, SmolLM2's layer shape (Hq 9, Hkv 3, D 64), B = 1,
bfloat16 K/V, K = 10, L = 150. With ``MAGICPIG_HOST_OPS_LIB`` naming another build of the
extension it times that build: run two builds in alternating processes to compare them
(``throughput/host_ops_nominsize_ab.json``).
"""
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from magicpig_jax import host, lsh
from magicpig_jax.attention import MagicPIGConfig

if len(sys.argv) != 2 or not sys.argv[1].isdigit() or int(sys.argv[1]) < 256:
    print(__doc__.splitlines()[0] + "\nN: the keys per row, an integer >= 256", file=sys.stderr)
    raise SystemExit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
N = int(sys.argv[1])
reps = 15
B, Hq, Hkv, D = 1, 9, 3, 64
rng = np.random.default_rng(0)
k = jnp.asarray(rng.standard_normal((B, Hkv, N, D)) + 1.5, jnp.bfloat16)
v = jnp.asarray(rng.standard_normal((B, Hkv, N, D)), jnp.bfloat16)
q = jnp.asarray(rng.standard_normal((B, Hq, D)) * 2, jnp.float32)
lengths = jnp.full((B,), N, jnp.int32)
cfg = MagicPIGConfig(K=10, L=150, num_sink=4, num_local=64)
proj = lsh.simhash_projections(jax.random.key(1), D, cfg.K, cfg.L)
hidx = host.host_build_index(k, proj, cfg, lengths, capacity=N)
fns = {
    "magicpig": jax.jit(lambda q: host.host_magicpig_attention(q, k, v, hidx, cfg, lengths)[0]),
    "exact": jax.jit(lambda q: host.host_exact_attention(q, k, v, lengths)[0]),
    "topk": jax.jit(lambda q: host.host_topk_attention(q, k, v, 0.05, lengths)[0]),
    "build": jax.jit(lambda k: host.host_build_index(k, proj, cfg, lengths, capacity=N)),
}
out = {}
for name, f in fns.items():
    arg = k if name == "build" else q
    jax.block_until_ready(f(arg))
    ts = []
    for _ in range(reps if name != "build" else 5):
        t = time.perf_counter()
        jax.block_until_ready(f(arg))
        ts.append(time.perf_counter() - t)
    out[name] = float(np.median(ts) * 1e3)
print(json.dumps({"lib": os.environ.get("MAGICPIG_HOST_OPS_LIB", "installed"), "N": N, **out}))
