"""Check the accelerator offload path of MagicPIG on this machine, and time it.

The KV cache and the LSH index of each layer live in host memory (a CPU device); the
query's hash codes, the static set (sinks + local window) and the merge run on the
accelerator (:mod:`magicpig_jax.offload`). The script builds a synthetic long-context
cache (keys in a narrow cone, as in real models, with a few keys aligned with each
query), then for every layer compares one offloaded decode step with

* the same step entirely on the host (``host_magicpig_attention``): must agree to
  float32 rounding (the sampled sets can differ only where the accelerator's matmul
  rounds a query projection across zero),
* dense attention over the whole cache on the accelerator (the estimate's error),

and times the offloaded step, its parts, and dense attention on the accelerator.

    pip install -e .                       # the package (builds the host op)
    pip install -U "jax[cuda12]"           # or jax[cuda13] / jax[tpu]; nothing else is needed
    python examples/accelerator_check.py   # < 5 minutes on a GPU machine
    python examples/accelerator_check.py --e2e --out runs/accelerator_e2e   # the decoder, < 5 minutes

On a CPU-only machine the accelerator is the CPU itself (use ``--context 8192
--layers 2`` for a quick run). Exit status 1 if the offloaded result disagrees with the
host-only one.

``--e2e`` checks the whole decoder instead: the embedded SmolLM2 with an 8K prompt (the
bundled LGPL text, repeated), prefilled once and copied to B = 1 and B = 16 rows, decoded
greedily by dense attention (on the accelerator) and by MagicPIG (on a GPU/TPU the offload
system: the sparse layers' KV cache and index in host memory); it prints and writes (JSON)
the aggregate tokens/s of each (median, min and max of 3 runs), how many of MagicPIG's
tokens equal dense's, and (B = 1) how many equal those of the pure-JAX reference run as a
single computation on the accelerator (``magicpig-ref``), which samples the same keys.
``--mechanisms`` times one layer's host part through the two JAX mechanisms: separate
computations on the CPU device (what the decoder uses) and the accelerator's ``pinned_host``
memory with ``compute_on("device_host")``.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from magicpig_jax import host, lsh, offload
from magicpig_jax.attention import MagicPIGConfig, dense_attention


def synthetic_layer(rng, B, Hq, Hkv, N, D, needles=8):
    """Keys in a cone around a shared direction plus noise, values around a mean per KV head; per query
    head a few keys close to the query, which then carry about half of the attention mass."""
    G = Hq // Hkv
    base = rng.standard_normal((1, Hkv, 1, D)).astype(np.float32) * 2.0
    k = base + rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    v = rng.standard_normal((1, Hkv, 1, D)).astype(np.float32) + rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    q = rng.standard_normal((B, Hq, D)).astype(np.float32)
    for h in range(Hq):
        pos = rng.integers(8, N - 128, size=(B, needles))
        for b in range(B):
            k[b, h // G, pos[b]] = base[0, h // G, 0] + 0.7 * q[b, h] + 0.3 * rng.standard_normal((needles, D))
    return q, k, v


def timed(fn, repeats):
    """Mean seconds of ``fn()`` over ``repeats`` calls after one warm-up call."""
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn())
    return (time.perf_counter() - t0) / repeats


def e2e(args) -> int:
    """The decoder end to end (see the module docstring); returns the exit status."""
    import json
    from pathlib import Path

    from magicpig_jax.eval.bench_decode import prompt_ids, time_method
    from magicpig_jax.eval.rss import PeakRSS
    from magicpig_jax.generation import prefill
    from magicpig_jax.io.loader import load_model

    accel, host_dev = offload.default_devices()
    options = {}
    if args.host_device is not None:  # tests: two virtual CPU devices stand in for accelerator and host
        host_dev = jax.devices()[args.host_device]
        options = {"offload": True, "host_device": host_dev}
    print(f"jax {jax.__version__}; accelerator: {accel} ({accel.platform}); host: {host_dev}")
    t_start = time.perf_counter()
    model = load_model(args.model)
    text = (Path(__file__).resolve().parent.parent / "magicpig_jax" / "data" / "lgpl-2.1.txt").read_text()
    # 8K on an 8K model: the prompt leaves room for the decoded tokens.
    ids = prompt_ids(model, text, min(args.context, model.config.max_position_embeddings - args.steps - 1))
    cfg = MagicPIGConfig(K=args.K, L=args.L, num_sink=args.num_sink, num_local=args.num_local)
    state = prefill(model, [ids], args.steps + 1)
    print(f"prompt {len(ids)} tokens, prefill {state.seconds:.1f} s")
    rss, rows = PeakRSS(), []
    for B in args.batches:
        res = {}
        for method in ("dense", "magicpig"):
            # dense stays on the accelerator (with a CPU stand-in, XLA's attention, not the host op)
            opts = options if method == "magicpig" else ({"host": False} if options else {})
            res[method] = r = time_method(model, state, method, B, args.steps, args.repeats, 0, cfg, rss, **opts)
            t = r["tokens_per_s"]
            print(f"B={B:>2} {method:>8}: {t['median']:8.1f} tokens/s [{t['min']:.1f}, {t['max']:.1f}] "
                  f"({r['runs_on']})", flush=True)
        same = sum(a == b for a, b in zip(res["dense"]["tokens"], res["magicpig"]["tokens"], strict=False))
        ratio = res["magicpig"]["tokens_per_s"]["median"] / res["dense"]["tokens_per_s"]["median"]
        print(f"B={B:>2}: MagicPIG / dense throughput {ratio:.2f}x; tokens equal to dense {same}/"
              f"{len(res['dense']['tokens'])}", flush=True)
        rows.append({"batch": B, "dense": res["dense"], "magicpig": res["magicpig"], "magicpig_over_dense": ratio,
                     "tokens_equal_to_dense": same})
    # The offload system against the single-device pure-JAX reference on the accelerator (B = 1): the
    # same sampled sets give the same greedy tokens, up to a code bit whose projection rounds across 0.
    ref = time_method(model, state, "magicpig-ref", 1, args.steps, 1, 0, cfg, rss,
                      **({"host": False} if options else {}))
    first = next((r for r in rows if r["batch"] == 1), None)
    same_ref = None
    if first is not None:
        same_ref = sum(a == b for a, b in zip(first["magicpig"]["tokens"], ref["tokens"], strict=False))
        first["tokens_equal_to_reference"] = same_ref
        print(f"B= 1: MagicPIG tokens equal to the pure-JAX reference's ({ref['runs_on']}) {same_ref}/"
              f"{len(ref['tokens'])}", flush=True)
    total = time.perf_counter() - t_start
    print(f"total {total:.1f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        meta = {"jax": jax.__version__, "accelerator": str(accel), "platform": accel.platform,
                "host": str(host_dev), "context": len(ids), "steps": args.steps, "repeats": args.repeats,
                "K": cfg.K, "L": cfg.L, "total_seconds": total}
        Path(args.out + ".json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
        print(f"wrote {args.out}.json")
    return 0


def mechanisms(args) -> int:
    """One layer's host part through the two JAX mechanisms (median ms of ``--steps`` calls each)."""
    from jax.experimental.compute_on import compute_on

    accel, host_dev = offload.default_devices()
    cfg = MagicPIGConfig(K=args.K, L=args.L, num_sink=args.num_sink, num_local=args.num_local)
    B, Hq, Hkv, N, D = args.batch, args.q_heads, args.kv_heads, args.context, args.head_dim
    rng = np.random.default_rng(args.seed)
    q, k, v = synthetic_layer(rng, B, Hq, Hkv, N, D)
    lengths = np.full((B,), N, np.int32)
    proj = lsh.simhash_projections(jax.random.key(0), D, cfg.K, cfg.L)
    k_h, v_h, proj_h, len_h = jax.device_put((k, v, proj, lengths), host_dev)
    index = jax.jit(host.host_build_index, static_argnames=("config",))(k_h, proj_h, cfg, len_h)
    q_a, proj_a = jax.device_put((q, proj), accel)
    codes = jax.jit(lsh.simhash_codes, static_argnums=(2, 3))(q_a, proj_a, cfg.K, cfg.L)
    W = cfg.static_window()

    def separate():
        q_h, c_h = jax.device_put((q_a, codes), host_dev)
        out = offload.host_part(q_h, c_h, offload.HostState(k_h, v_h, index, len_h, W))
        return jax.device_put(out[:2], accel)

    print(f"one layer: B={B} Hq={Hq} Hkv={Hkv} N={N} D={D}; accelerator {accel}, host {host_dev}")
    print(f"separate computations on the CPU device: {1e3 * timed(separate, args.steps):.3f} ms per layer step")
    try:
        pinned = jax.sharding.SingleDeviceSharding(accel, memory_kind="pinned_host")
        k_p, v_p, idx_p, len_p = jax.device_put((k_h, v_h, index, len_h), pinned)

        @jax.jit
        def memory_kinds(q, codes, k, v, idx, lens):
            @compute_on(compute_type="device_host", out_memory_spaces=(jax.memory.Space.Device,) * 3)
            def on_host(q, codes, k, v, idx, lens):
                return host.host_sampled_attention(q, codes, k, v, idx, lens, window=W)

            return on_host(q, codes, k, v, idx, lens)[:2]

        t = timed(lambda: memory_kinds(q_a, codes, k_p, v_p, idx_p, len_p), args.steps)
        print(f"pinned_host memory + compute_on('device_host'): {1e3 * t:.3f} ms per layer step")
    except Exception as e:  # noqa: BLE001 - report whatever the backend refuses
        print(f"pinned_host memory + compute_on('device_host'): not available here ({type(e).__name__}: "
              f"{str(e).splitlines()[0][:300]})")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--q-heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--context", type=int, default=None, help="keys per row (default 32768; --e2e: 8192)")
    ap.add_argument("--layers", type=int, default=4, help="independent layers (caches) to check")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed repetitions per layer (default 20; --e2e: decode steps, default 32)")
    ap.add_argument("--K", type=int, default=10)
    ap.add_argument("--L", type=int, default=150)
    ap.add_argument("--num-sink", type=int, default=4)
    ap.add_argument("--num-local", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--e2e", action="store_true", help="the decoder end to end on the embedded model")
    ap.add_argument("--mechanisms", action="store_true", help="time one layer's host part by both JAX mechanisms")
    ap.add_argument("--model", default=None, help="--e2e: the model (default: the embedded SmolLM2)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="--e2e: batch sizes")
    ap.add_argument("--repeats", type=int, default=3, help="--e2e: timed runs per (B, method)")
    ap.add_argument("--host-device", type=int, default=None,
                    help="--e2e: force offload with jax.devices()[i] as the host (two-CPU-device tests)")
    ap.add_argument("--out", default=None, help="--e2e: write <out>.json")
    args = ap.parse_args(argv)
    if args.context is None:  # None: not given (a check of argv missed --context=N and abbreviations)
        args.context = 8192 if args.e2e else 32768
    if args.steps is None:
        args.steps = 32 if args.e2e else 20
    for name in ("layers", "steps", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.e2e and args.context < 256:  # the synthetic keys plant needles in [8, context - 128)
        ap.error(f"--context must be >= 256, got {args.context}")
    if args.e2e:
        return e2e(args)
    if args.mechanisms:
        return mechanisms(args)

    accel, host_dev = offload.default_devices()
    cfg = MagicPIGConfig(K=args.K, L=args.L, num_sink=args.num_sink, num_local=args.num_local)
    B, Hq, Hkv, N, D = args.batch, args.q_heads, args.kv_heads, args.context, args.head_dim
    print(f"jax {jax.__version__}; accelerator: {accel} ({accel.platform}); host: {host_dev}; "
          f"CPU devices: {len(jax.devices('cpu'))}; AVX2 kernels: {host.has_avx2()}")
    print(f"B={B} Hq={Hq} Hkv={Hkv} N={N} D={D} K={cfg.K} L={cfg.L} sinks={cfg.num_sink} "
          f"local={cfg.num_local}; {args.layers} layers x {args.steps} timed steps")
    kv_bytes = 2 * B * Hkv * N * D * 4
    rng = np.random.default_rng(args.seed)
    lengths = np.full((B,), N, np.int32)
    lengths[-1] = N - N // 7  # a shorter row
    build = jax.jit(host.host_build_index, static_argnames=("config", "capacity"))
    dense_acc = jax.jit(dense_attention)
    host_only = jax.jit(host.host_magicpig_attention, static_argnames=("config", "static_window"))

    ok = True
    rows = []
    t_start = time.perf_counter()
    for layer in range(args.layers):
        q, k, v = synthetic_layer(rng, B, Hq, Hkv, N, D)
        proj = lsh.simhash_projections(jax.random.key(layer), D, cfg.K, cfg.L)
        k_h, v_h, proj_h, len_h = jax.device_put((k, v, proj, lengths), host_dev)
        t0 = time.perf_counter()
        index = jax.block_until_ready(build(k_h, proj_h, cfg, len_h, capacity=N))
        t_build = time.perf_counter() - t0
        a_state, h_state = offload.prepare_offload(k_h, v_h, index, cfg, len_h, accel_device=accel,
                                                   host_device=host_dev)
        q_a = jax.device_put(q, accel)

        out, lse, ns = offload.offload_magicpig_attention(q_a, a_state, h_state, cfg)
        r_out, r_lse, r_ns = host_only(jax.device_put(q, host_dev), k_h, v_h, index, cfg, len_h,
                                       static_window=h_state.window)
        k_a, v_a, len_a = jax.device_put((k, v, lengths), accel)  # dense baseline: whole cache on the accelerator
        d_out, d_lse = dense_acc(q_a, k_a, v_a, len_a)
        out, lse, ns, r_out, r_lse, r_ns, d_out, d_lse = map(np.asarray, (out, lse, ns, r_out, r_lse, r_ns,
                                                                          d_out, d_lse))
        agree = float(np.mean(ns == r_ns))
        diff_host = float(np.max(np.abs(out - r_out))) if agree == 1.0 else float("nan")
        rel_dense = np.linalg.norm(out - d_out, axis=-1) / np.maximum(np.linalg.norm(d_out, axis=-1), 1e-30)
        frac = float(np.mean(ns / lengths[:, None]))
        # Tolerance: identical sampled sets give float32 rounding differences only.
        if agree == 1.0 and not (diff_host < 1e-4 and np.max(np.abs(lse - r_lse)) < 1e-4):
            ok = False
        if agree < 0.99:
            ok = False

        t_off = timed(lambda q_a=q_a, a=a_state, h=h_state: offload.offload_magicpig_attention(q_a, a, h, cfg)[:2],
                      args.steps)
        codes, o_s, l_s = offload.accelerator_part(q_a, a_state, K=cfg.K, L=cfg.L)
        t_acc = timed(lambda q_a=q_a, a=a_state: offload.accelerator_part(q_a, a, K=cfg.K, L=cfg.L), args.steps)
        q_h, c_h = jax.device_put((q_a, codes), host_dev)
        t_host = timed(lambda q_h=q_h, c_h=c_h, h=h_state: offload.host_part(q_h, c_h, h), args.steps)
        t_dense = timed(lambda q_a=q_a, k_a=k_a, v_a=v_a, len_a=len_a: dense_acc(q_a, k_a, v_a, len_a),
                        args.steps)
        del k_a, v_a
        rows.append((layer, frac, agree, diff_host, float(np.mean(rel_dense)), float(np.max(rel_dense)),
                     t_build, t_off, t_acc, t_host, t_dense))
        print(f"layer {layer}: sampled {100 * frac:5.2f}% of keys | same sampled sets as host-only: "
              f"{100 * agree:6.2f}% of heads, max |out diff| {diff_host:.2e} | rel. error vs dense: "
              f"mean {np.mean(rel_dense):.3f} max {np.max(rel_dense):.3f} | index build {t_build:.2f} s | "
              f"offloaded step {1e3 * t_off:.2f} ms (accel part {1e3 * t_acc:.2f}, host op {1e3 * t_host:.2f}) | "
              f"dense on accel {1e3 * t_dense:.2f} ms", flush=True)

    r = np.array([row[1:] for row in rows])
    print("=== summary ===")
    print(f"KV cache per layer: {kv_bytes / 2**20:.0f} MiB in host memory; index "
          f"{host.index_nbytes(index) / 2**20:.0f} MiB per layer")
    print(f"sampled fraction {100 * r[:, 0].mean():.2f}%; heads with identical sampled sets "
          f"{100 * r[:, 1].mean():.2f}%; rel. error vs dense mean {r[:, 3].mean():.3f}")
    print(f"time per layer step: offloaded {1e3 * r[:, 6].mean():.2f} ms (accelerator part "
          f"{1e3 * r[:, 7].mean():.2f} ms, host op {1e3 * r[:, 8].mean():.2f} ms), dense on the accelerator "
          f"{1e3 * r[:, 9].mean():.2f} ms; index build {r[:, 5].mean():.2f} s per layer")
    print(f"total {time.perf_counter() - t_start:.1f} s; offloaded result matches host-only: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
