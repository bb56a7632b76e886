"""Time the host SimHash kernel on one layer's worth of rows, layer after layer, as a decode step does.

  MAGICPIG_HOST_OPS_LIB=<build>.so python measure.py --rows 9 --layout plain --json out.json

``--layers`` distinct float32 [64, 1500] hyperplane matrices (K = 10, L = 150: 384 KB each; 200 of
them are 77 MB, more than the 32 MiB L3, so each call reads its matrix from memory, as a decode
step does after the weight products have streamed through the caches) are hashed in one jitted
chain: each call's rows depend on the previous call's codes, so the calls run one after another
as the layers of a step do. Reports microseconds per layer (median, min, max of ``--reps``
repetitions of the chain) and checks that the codes equal ``magicpig_jax.lsh.simhash_codes``.

``--layout panels`` passes the hyperplanes as [ceil(K*L/64), D, 64] panels, which only the build of
``panel_layout.patch`` accepts; ``wide_12_rows.patch`` changes ``impl=auto`` (this script's) to its
12-row pass. Both patches apply to commit dbb9676; neither was kept (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from magicpig_jax import lsh
from magicpig_jax.host._ext import ops

D, K, L = 64, 10, 150


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=9, help="rows hashed per layer (B * Hq)")
    p.add_argument("--layers", type=int, default=200)
    p.add_argument("--threads", type=int, default=0, help="the op's max_threads (0: XLA's pool)")
    p.add_argument("--layout", choices=["plain", "panels"], default="plain")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    ops()
    C = K * L
    W = -(-C // 64)
    rng = np.random.default_rng(0)
    planes = [rng.standard_normal((D, C)).astype(np.float32) for _ in range(a.layers)]
    if a.layout == "panels":
        def panel(P):
            Pp = np.zeros((D, W * 64), np.float32)
            Pp[:, :C] = P
            return np.ascontiguousarray(Pp.reshape(D, W, 64).transpose(1, 0, 2))
        args = [jnp.asarray(panel(P)) for P in planes]
    else:
        args = [jnp.asarray(P) for P in planes]
    x = jnp.asarray(rng.standard_normal((a.rows, D)).astype(np.float32))
    center = jnp.zeros((1, D), jnp.float32)

    def call(P, xx):
        return jax.ffi.ffi_call("magicpig_simhash_codes", jax.ShapeDtypeStruct((a.rows, L), jnp.uint32))(
            xx, center, P, K=np.int64(K), L=np.int64(L), impl=np.int64(0), max_threads=np.int64(a.threads))

    @jax.jit
    def chain(Ps):
        out, xx = [], x
        for P in Ps:
            c = call(P, xx)
            out.append(c)
            xx = x + jnp.where(c[0, 0] == 123456789, 1.0, 0.0)  # a dependence XLA cannot fold away
        return out

    codes = chain(args)
    for P, c in zip(planes[:3], codes[:3], strict=True):
        np.testing.assert_array_equal(np.asarray(c), np.asarray(lsh.simhash_codes(x, jnp.asarray(P), K, L)))
    us = []
    for _ in range(a.reps):
        t = time.perf_counter()
        jax.block_until_ready(chain(args))
        us.append((time.perf_counter() - t) / a.layers * 1e6)
    res = {"rows": a.rows, "layers": a.layers, "threads": a.threads, "layout": a.layout,
           "lib": os.environ.get("MAGICPIG_HOST_OPS_LIB", "installed"), "us_per_layer": {
               "median": float(np.median(us)), "min": float(min(us)), "max": float(max(us)), "values": us}}
    print(f"{a.layout} rows={a.rows} threads={a.threads}: {res['us_per_layer']['median']:.1f} us/layer "
          f"[{res['us_per_layer']['min']:.1f}, {res['us_per_layer']['max']:.1f}]")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
