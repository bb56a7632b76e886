"""magicpig_jax.offload: the accelerator offload path, with two CPU devices standing in for the two sides.

'Accelerator' = cpu:0, host = cpu:1 (two virtual CPU devices, so the checks run in a
subprocess that sets ``XLA_FLAGS`` before JAX starts). The offloaded step must equal
``host_magicpig_attention`` and the pure-JAX ``magicpig_attention``, with the KV cache
and the index staying on the host device and only small arrays on the accelerator.
``examples/accelerator_check.py`` is run too (CPU-only: accelerator = host = the CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._xla import with_test_flag

ROOT = Path(__file__).resolve().parent.parent
NUM_LOCAL = 8  # the subprocess's cfg.num_local

_CHECKS = textwrap.dedent(r'''
    import dataclasses, json, os, traceback
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    from magicpig_jax import host, lsh, offload
    from magicpig_jax.attention import MagicPIGConfig, build_lsh_index, magicpig_attention

    accel, host_dev = jax.devices()
    R = {"devices": [str(accel), str(host_dev)]}
    B, Hq, Hkv, N, D = 3, 8, 2, 400, 16
    cfg = MagicPIGConfig(K=6, L=20, num_sink=3, num_local=8)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, D), np.float32)
    k = rng.standard_normal((B, Hkv, N, D), np.float32) + np.float32(0.5)
    v = rng.standard_normal((B, Hkv, N, D), np.float32)
    proj = rng.standard_normal((D, cfg.K * cfg.L), np.float32)
    lengths = np.array([400, 250, 17], np.int32)

    build = jax.jit(host.host_build_index, static_argnames=("config", "capacity"))
    attend = jax.jit(host.host_magicpig_attention, static_argnames=("config", "static_window"))
    ref_build = jax.jit(build_lsh_index, static_argnames=("config",))
    ref_attend = jax.jit(magicpig_attention, static_argnames=("config",))

    def check(name, fn):
        try:
            R[name] = fn()
        except Exception:
            R[name] = {"error": traceback.format_exc()}

    def compare(got, want):
        out, lse, ns = (np.asarray(x) for x in got)
        want = [np.asarray(x) for x in want]
        fin = np.isfinite(want[1])
        return {
            "ns_equal": bool(np.array_equal(ns, want[2])),
            "out_diff": float(np.max(np.abs(out - want[0]))),
            "lse_diff": float(np.max(np.abs(lse[fin] - want[1][fin]))),
            "lse_inf_equal": bool(np.array_equal(np.isneginf(lse), np.isneginf(want[1]))),
            "any_sampled": bool(ns.sum() > 0),
        }

    def devices_of(tree):
        return sorted({str(d) for leaf in jax.tree.leaves(tree) for d in leaf.devices()})

    def case(window, dtype):
        kk, vv = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
        k_h, v_h = jax.device_put((kk, vv), host_dev)
        index = build(k_h, jax.device_put(proj, host_dev), cfg, jax.device_put(lengths, host_dev), capacity=N)
        a_state, h_state = offload.prepare_offload(k_h, v_h, index, cfg, lengths, accel_device=accel,
                                                   host_device=host_dev, static_window=window)
        got = offload.offload_magicpig_attention(jax.device_put(q, accel), a_state, h_state, cfg)
        res = {"vs_host": compare(got, attend(jnp.asarray(q), kk, vv, index, cfg, jnp.asarray(lengths),
                                              static_window=h_state.window))}
        ri = ref_build(kk, jnp.asarray(proj), cfg, jnp.asarray(lengths))
        res["vs_pure_jax"] = compare(got, ref_attend(jnp.asarray(q), kk, vv, ri, cfg, jnp.asarray(lengths)))
        res["out_device"] = devices_of(got[:2])
        res["num_sampled_device"] = devices_of(got[2])
        res["accel_state_devices"] = devices_of(a_state)
        res["host_state_devices"] = devices_of(h_state)
        res["accel_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(a_state)))
        res["kv_bytes"] = int(k_h.nbytes + v_h.nbytes)
        res["window"] = h_state.window
        W = min(h_state.window, N)
        res["static_bytes"] = int(2 * B * Hkv * (cfg.num_sink + W) * D * kk.dtype.itemsize + proj.nbytes + 2 * B * 4)
        return res

    for window, dtype in ((0, "float32"), (20, "float32"), (None, "float32"), (20, "bfloat16")):
        check(f"case_{window}_{dtype}", lambda w=window, d=dtype: case(w, jnp.dtype(d)))

    def parts_run_where_placed():
        # The host part is compiled for, and runs on, the host device only; the accelerator part never
        # receives the cache.
        k_h, v_h = jax.device_put((k, v), host_dev)
        index = build(k_h, jax.device_put(proj, host_dev), cfg, jax.device_put(lengths, host_dev), capacity=N)
        a_state, h_state = offload.prepare_offload(k_h, v_h, index, cfg, lengths, accel_device=accel,
                                                   host_device=host_dev, static_window=20)
        q_a = jax.device_put(q, accel)
        codes, o_s, l_s = offload.accelerator_part(q_a, a_state, K=cfg.K, L=cfg.L)
        acc_args = [tuple(x.shape) for x in jax.tree.leaves((q_a, a_state))]
        q_h, c_h = jax.device_put((q_a, codes), host_dev)
        o_h, l_h, ns = offload.host_part(q_h, c_h, h_state)
        ref_codes = np.asarray(jax.jit(lsh.simhash_codes, static_argnums=(2, 3))(jnp.asarray(q), jnp.asarray(proj),
                                                                               cfg.K, cfg.L))
        return {
            "codes_device": devices_of(codes), "static_device": devices_of((o_s, l_s)),
            "host_out_device": devices_of((o_h, l_h, ns)),
            "accel_arg_shapes": acc_args,
            "codes_equal": bool(np.array_equal(np.asarray(codes), ref_codes)),
        }

    check("parts", parts_run_where_placed)

    def errors():
        out = {}
        k_h = jax.device_put(k, host_dev)
        index = build(k_h, jax.device_put(proj, host_dev), cfg, jax.device_put(lengths, host_dev), capacity=N)
        cases = {
            "window": lambda: offload.prepare_offload(k_h, k_h, index, cfg, lengths, accel_device=accel,
                                                      host_device=host_dev, static_window=-1),
            "lengths": lambda: offload.prepare_offload(k_h, k_h, index, cfg, np.array([401, 1, 1], np.int32),
                                                       accel_device=accel, host_device=host_dev),
            "config": lambda: offload.prepare_offload(k_h, k_h, index, MagicPIGConfig(K=7, L=20), lengths,
                                                      accel_device=accel, host_device=host_dev),
        }
        a_state, h_state = offload.prepare_offload(k_h, k_h, index, cfg, lengths, accel_device=accel,
                                                   host_device=host_dev)
        q_a = jax.device_put(q, accel)
        # a static set other than the one placed cannot take effect: refused, not ignored
        cases["other_num_local"] = lambda: offload.offload_magicpig_attention(
            q_a, a_state, h_state, dataclasses.replace(cfg, num_local=cfg.num_local + 1))
        # these were accepted (v) or named the sinks' or projections' shapes, or raised AttributeError
        cases["v_shape"] = lambda: offload.prepare_offload(k_h, k_h[:, :, :300], index, cfg, lengths,
                                                           accel_device=accel, host_device=host_dev)
        cases["v_dtype"] = lambda: offload.prepare_offload(k_h, k_h.astype(jnp.bfloat16), index, cfg, lengths,
                                                           accel_device=accel, host_device=host_dev)
        cases["k_list"] = lambda: offload.prepare_offload(np.asarray(k).tolist(), k_h, index, cfg, lengths,
                                                          accel_device=accel, host_device=host_dev)
        cases["q_dim"] = lambda: offload.offload_magicpig_attention(q_a[..., :8], a_state, h_state, cfg)
        cases["q_rows"] = lambda: offload.offload_magicpig_attention(q_a[:2], a_state, h_state, cfg)
        cases["no_config"] = lambda: offload.offload_magicpig_attention(q_a, a_state, h_state, None)
        cases["device_name"] = lambda: offload.prepare_offload(k_h, k_h, index, cfg, lengths, accel_device=accel,
                                                               host_device="cpu")
        for name, fn in cases.items():
            try:
                fn()
                out[name] = "no error"
            except (ValueError, TypeError) as e:
                out[name] = f"{type(e).__name__}: {e}"
        # equal K, L and static set: accepted, whatever else differs (seed, class)
        from magicpig_jax.attention import HybridConfig
        out["same_config"] = all(bool(np.all(np.isfinite(np.asarray(
            offload.offload_magicpig_attention(q_a, a_state, h_state, c)[0]))))
            for c in (dataclasses.replace(cfg), dataclasses.replace(cfg, seed=cfg.seed + 1),
                      HybridConfig(**dataclasses.asdict(cfg), heavy=5)))
        return out

    check("errors", errors)
    print("RESULT " + json.dumps(R))
''')


def _env() -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = with_test_flag()  # the script adds its device count
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.fixture(scope="module")
def results():
    proc = subprocess.run([sys.executable, "-c", _CHECKS], capture_output=True, text=True, env=_env(), timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _ok(res: dict, name: str) -> dict:
    r = res[name]
    assert "error" not in r, r.get("error")
    return r


def _assert_equal(r: dict, tol: float) -> None:
    assert r["ns_equal"] and r["lse_inf_equal"] and r["any_sampled"], r
    assert r["out_diff"] <= tol and r["lse_diff"] <= tol, r


CASES = ["case_0_float32", "case_20_float32", "case_None_float32", "case_20_bfloat16"]


def test_two_devices(results):
    assert len(set(results["devices"])) == 2


@pytest.mark.parametrize("name", CASES)
def test_offload_equals_host_op_and_reference(results, name):
    r = _ok(results, name)
    _assert_equal(r["vs_host"], 1e-6)
    _assert_equal(r["vs_pure_jax"], 2e-5)


@pytest.mark.parametrize("name", CASES)
def test_cache_and_index_stay_on_the_host(results, name):
    r = _ok(results, name)
    accel, host_dev = results["devices"]
    assert r["host_state_devices"] == [host_dev]
    assert r["accel_state_devices"] == [accel]
    assert r["out_device"] == [accel]
    assert r["num_sampled_device"] == [host_dev]
    assert r["accel_bytes"] == r["static_bytes"]  # hyperplanes + sinks + tail window only
    if r["window"] <= 20:
        assert r["accel_bytes"] < r["kv_bytes"] / 4


def test_parts_run_where_placed(results):
    r = _ok(results, "parts")
    accel, host_dev = results["devices"]
    assert r["codes_device"] == [accel] and r["static_device"] == [accel]
    assert r["host_out_device"] == [host_dev]
    assert r["codes_equal"]
    assert all(400 not in shape for shape in r["accel_arg_shapes"])  # no N-sized array on the accelerator


def test_errors(results):
    e = _ok(results, "errors")
    assert "static_window" in e["window"]
    assert "lengths must be in [0, 400]" in e["lengths"]
    assert "K=7" in e["config"]
    assert e["other_num_local"].startswith("ValueError: config must have the K, L and static set given to "
                                           "prepare_offload")
    assert f"num_local={NUM_LOCAL + 1} (prepared with {NUM_LOCAL})" in e["other_num_local"], e["other_num_local"]
    assert e["same_config"]  # an equal config (another object) is accepted
    assert e["v_shape"] == "ValueError: v must have k's shape (3, 2, 400, 16), got (3, 2, 300, 16)"
    assert e["v_dtype"] == "TypeError: v must have k's dtype float32, got bfloat16"  # as the host op's check
    assert e["k_list"] == "TypeError: k must be a JAX or NumPy array [B, Hkv, N, D], got list"
    assert e["q_dim"] == ("ValueError: q must be [B, Hq, D] with the layer's B = 3, D = 16 and Hq a multiple of "
                          "Hkv = 2, got (3, 8, 8)")
    assert "got (2, 8, 16)" in e["q_rows"]
    assert e["no_config"].startswith("TypeError: config must be a MagicPIGConfig")
    assert e["device_name"] == ("TypeError: host_device must be a jax.Device (e.g. jax.devices('cpu')[0]), "
                                "got 'cpu'")


def test_donating_the_host_index_keeps_the_accelerators_hyperplanes_on_one_device():
    """With accel_device == host_device (a CPU-only machine), the accelerator state and the index
    shared one hyperplane buffer: donating the index to host_append, as its docstring says, deleted
    the accelerator's, and the next step failed with 'Array has been deleted'."""
    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from magicpig_jax import host, offload
    from magicpig_jax.attention import MagicPIGConfig

    cpu = jax.devices("cpu")[0]
    cfg = MagicPIGConfig(K=6, L=20, num_sink=2, num_local=4)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((1, 2, 64, 16), np.float32))
    q = jnp.asarray(rng.standard_normal((1, 4, 16), np.float32))
    proj = jnp.asarray(rng.standard_normal((16, cfg.K * cfg.L), np.float32))
    index = host.host_build_index(k, proj, cfg, capacity=128)
    a_state, h_state = offload.prepare_offload(k, k, index, cfg, accel_device=cpu, host_device=cpu)
    appended = jax.jit(host.host_append, donate_argnums=0)(h_state.index, k[:, :, :2], jnp.array([2], jnp.int32))
    assert not a_state.projections.is_deleted()
    out, _, _ = offload.offload_magicpig_attention(q, a_state, dataclasses.replace(h_state, index=appended), cfg)
    assert np.isfinite(np.asarray(out)).all()


def test_accelerator_check_script_runs_on_cpu():
    cmd = [sys.executable, str(ROOT / "examples" / "accelerator_check.py"), "--batch", "2", "--q-heads", "4",
           "--kv-heads", "2", "--head-dim", "32", "--context", "2048", "--layers", "1", "--steps", "2",
           "--K", "8", "--L", "40", "--num-local", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "offloaded result matches host-only: OK" in proc.stdout
    assert "(cpu); host:" in proc.stdout


# ---------------------------------------------------------------------------------------------
# The decoder: generate(attention="magicpig") as the offload system ("magicpig-offload").
# ---------------------------------------------------------------------------------------------

_DECODER = textwrap.dedent(r'''
    import dataclasses, json, os, sys
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
    sys.path.insert(0, os.environ["ROOT"])
    import jax, jax.numpy as jnp, numpy as np
    from magicpig_jax.attention import MagicPIGConfig
    from magicpig_jax.decode_loop import Sampling, start_decode
    from magicpig_jax.generation import prefill
    from magicpig_jax.models.backends import DecodeSpec, backend_for
    from tests._tiny import tiny_model

    accel, host_dev = jax.devices()
    model = tiny_model(0)
    rng = np.random.default_rng(0)
    # the third row is shorter than num_sink: the sinks fill as it decodes, and are never hashed
    prompts = [[int(t) for t in rng.integers(1, 90, 300)], [int(t) for t in rng.integers(1, 90, 250)], [7]]
    R = {"devices": [str(accel), str(host_dev)]}

    def both(m, state, base, steps):
        """The finished one-device and offload runs of ``m`` from ``state`` (DecodeSpec fields ``base``)."""
        runs = {}
        for name, spec in (("one_device", DecodeSpec(**base)),
                           ("offload", DecodeSpec(**base, offload=True, host_device=host_dev))):
            runs[name] = start_decode(m, state, spec, steps, Sampling())
            for _ in runs[name]:
                pass
        return runs

    for dtype in ("float32", "bfloat16"):
        state = prefill(model, prompts, 40, cache_dtype=jnp.dtype(dtype))
        cfg = MagicPIGConfig(K=6, L=20, num_sink=2, num_local=8)
        # generation_buffer=8: the ring of the last W = 24 positions wraps and the index appends
        # generated tokens every 8 steps within the 40.
        base = dict(backend="magicpig", magicpig=cfg, dense_layers=(0,), generation_buffer=8)
        out = {}
        for name, spec in (("one_device", DecodeSpec(**base)),
                           ("offload", DecodeSpec(**base, offload=True, host_device=host_dev))):
            run = start_decode(model, state, spec, 40, Sampling())
            for _ in run:
                pass
            stats = run.stats()
            r = {"tokens": run.outputs, "runs_on": stats["attention_runs_on"],
                 "sampled_fraction": stats["sampled_fraction"]}
            if name == "offload":
                sparse = spec.sparse_layers(model.config.num_layers)
                dev = lambda tree: sorted({str(d) for x in jax.tree.leaves(tree) for d in x.devices()})
                r["sparse_kv_devices"] = dev([(run.cache.k[i], run.cache.v[i]) for i in sparse])
                r["index_devices"] = dev([run.indices[i].index for i in sparse])
                r["accel_state_devices"] = dev([dataclasses.replace(run.indices[i], index=None) for i in sparse])
                r["accel_state_shapes"] = sorted({tuple(x.shape) for i in sparse for x in
                                                  jax.tree.leaves(dataclasses.replace(run.indices[i], index=None))})
                r["dense_kv_devices"] = dev([(run.cache.k[0], run.cache.v[0])])
                r["index_end"] = np.asarray(run.indices[sparse[0]].index.end).tolist()
                r["index_start"] = np.asarray(run.indices[sparse[0]].index.start).tolist()
                r["prompt_lengths"] = [len(p) for p in prompts]
                r["capacity"] = int(run.cache.capacity)
            out[name] = r
        R[dtype] = out
    # A sliding window of 16 on the dense layer 0: the offload segments window it as the one-device step does.
    from tests._tiny import TINY
    windowed = tiny_model(0, dataclasses.replace(TINY, sliding_window=16, sliding_layers=(0,)))
    state = prefill(windowed, prompts, 12)
    cfg = MagicPIGConfig(K=6, L=20, num_sink=2, num_local=8)
    base = dict(backend="magicpig", magicpig=cfg, dense_layers=(0,), generation_buffer=8)
    R["windowed"] = {name: run.outputs for name, run in both(windowed, state, base, 12).items()}
    # A generation buffer far past the cache: the accelerator's ring is capped at the cache's capacity.
    state = prefill(model, prompts, 8)
    big = dict(backend="magicpig", magicpig=cfg, dense_layers=(0,), generation_buffer=4096)
    runs = both(model, state, big, 8)
    sparse = DecodeSpec(**big).sparse_layers(model.config.num_layers)
    R["big_buffer"] = {name: run.outputs for name, run in runs.items()} | {
        "ring_slots": int(runs["offload"].indices[sparse[0]].ring_k.shape[2]), "capacity": int(state.cache.capacity)}
    # Context 255, capacity 256: the 250-token row stops at the context after 6 tokens while the
    # 10-token row decodes 20; the stopped row's steps write nothing once it is full.
    short_ctx = tiny_model(0, dataclasses.replace(TINY, max_position_embeddings=255))
    crng = np.random.default_rng(1)
    rows = [[int(t) for t in crng.integers(1, 90, 250)], [int(t) for t in crng.integers(1, 90, 10)]]
    state = prefill(short_ctx, rows, 20)
    R["context"] = {name: [run.outputs, run.stop_reasons, int(state.cache.capacity),
                           np.asarray(run.cache.lengths).tolist()]
                    for name, run in both(short_ctx, state, base, 20).items()}
    # Gemma 3 (the transformers fixture): sandwich norms, the local RoPE base on its windowed
    # layers 0 and 2 (dense here: their window of 8 binds), the query scale on the sparse layer 1;
    # Gemma 2: attention logit soft-capping in the host op, the static part and the dense layers 0
    # and 2, final logit soft-capping, the sparse layers 1 and 3
    from magicpig_jax.io.loader import load_model
    for family in ("gemma3", "gemma2"):
        gemma = load_model(os.path.join(os.environ["ROOT"], "tests", "fixtures", "families", family))
        state = prefill(gemma, [[int(t) for t in rng.integers(3, 600, 300)]], 12)
        base = dict(backend="magicpig", magicpig=cfg, dense_layers=(0, 2), generation_buffer=8)
        R[family] = {name: [run.outputs, run.stats()["sampled_fraction"]]
                     for name, run in both(gemma, state, base, 12).items()}
    R["auto_on_cpu"] = backend_for(DecodeSpec(backend="magicpig")).name
    # Two models of one architecture (one cached offload step serves both) decoding in two threads
    # at once, three runs each: each run's tokens equal its model's run alone.
    import gc, threading, weakref
    from flax import nnx
    base = dict(backend="magicpig", magicpig=cfg, dense_layers=(0,), generation_buffer=8)
    spec = DecodeSpec(**base, offload=True, host_device=host_dev)
    models = [tiny_model(0), tiny_model(1)]
    states = [prefill(m, prompts[:2], 24) for m in models]
    def decode(i):
        run = start_decode(models[i], states[i], spec, 24, Sampling())
        for _ in run:
            pass
        return run.outputs
    alone = [decode(i) for i in range(2)]
    threaded = [[], []]
    def worker(i):
        for _ in range(3):
            try:
                threaded[i].append(decode(i))
            except Exception as e:
                threaded[i].append(f"{type(e).__name__}: {e}")
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    R["threads"] = {"alone": alone, "threaded": threaded}
    # A model decoded by the offload step is freed once the caller drops it (the cached step holds no weights).
    refs = [weakref.ref(x) for x in jax.tree.leaves(nnx.split(models[0].module)[1])]
    decode(0)  # the model the step ran last
    del models, states
    gc.collect()
    R["weights_alive_after_del"] = [sum(r() is not None for r in refs), len(refs)]
    print("RESULT " + json.dumps(R))
''')


@pytest.fixture(scope="module")
def decoder_results():
    env = _env() | {"ROOT": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _DECODER], capture_output=True, text=True, env=env, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_decoder_gives_the_single_device_tokens(decoder_results, dtype):
    r = decoder_results[dtype]
    assert "offload" in r["offload"]["runs_on"] and "host op" in r["one_device"]["runs_on"]
    assert r["offload"]["tokens"] == r["one_device"]["tokens"]
    assert all(len(t) == 40 for t in r["offload"]["tokens"])
    assert r["offload"]["sampled_fraction"] == pytest.approx(r["one_device"]["sampled_fraction"], rel=1e-6)
    assert r["offload"]["sampled_fraction"] > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offload_decoder_keeps_kv_and_index_on_the_host(decoder_results, dtype):
    accel, host_dev = decoder_results["devices"]
    r = decoder_results[dtype]["offload"]
    assert r["sparse_kv_devices"] == [host_dev] and r["index_devices"] == [host_dev]
    assert r["accel_state_devices"] == [accel]  # hyperplanes, sinks, the ring of the last W positions
    assert r["dense_kv_devices"] == [accel]  # the dense layer stays on the accelerator
    assert all(r["capacity"] not in shape for shape in r["accel_state_shapes"])  # nothing N-sized there
    # Generated tokens reached the host index (appends every 8 steps once the tail exceeds W).
    assert all(end > n - 8 for end, n in zip(r["index_end"], r["prompt_lengths"], strict=True))
    assert r["index_start"] == [2, 2, 2]  # num_sink, the 1-token prompt's row too


def test_offload_decoder_ring_is_capped_at_the_cache(decoder_results):
    """A ring of num_local + 2 x generation_buffer positions held GBs past a small cache."""
    r = decoder_results["big_buffer"]
    assert r["offload"] == r["one_device"]
    assert r["ring_slots"] == r["capacity"] < 8 + 2 * 4096


@pytest.mark.parametrize("family", ["gemma3", "gemma2"])
def test_offload_decoder_runs_gemma(decoder_results, family):
    """Gemma 3's layer structure (sandwich norms, per-layer RoPE bases, query scale) and Gemma 2's
    soft-capping in the offload segments and its host layer: the one-device step's tokens (checked
    against transformers in test_gemma3 / test_gemma2), sampling."""
    (one, frac_one), (off, frac_off) = decoder_results[family]["one_device"], decoder_results[family]["offload"]
    assert off == one and len(off[0]) == 12
    assert frac_off == pytest.approx(frac_one, rel=1e-6) and 0 < frac_off < 1


def test_offload_decoder_lets_a_batch_decode_past_a_row_stopped_by_the_context(decoder_results):
    """A row that stopped at the context keeps taking the batch's steps: past the capacity they
    write nothing (as the one-device step), and the tokens equal the one-device step's."""
    one, off = decoder_results["context"]["one_device"], decoder_results["context"]["offload"]
    assert one[2] == 256 and one[1] == ["context", "length"] and [len(t) for t in one[0]] == [6, 20]
    assert off[:2] == one[:2]
    assert off[3] == one[3] == [256, 29]  # the full row kept its length (10 + 19 steps for the other)


def test_offload_decoder_windows_its_dense_layers(decoder_results):
    """A dense layer with a sliding window (16 positions of a 300-token prompt) runs windowed in the
    offload segments: the tokens equal the one-device step's, whose window is checked against
    transformers (test_sliding_window)."""
    r = decoder_results["windowed"]
    assert r["offload"] == r["one_device"] and all(len(t) == 12 for t in r["offload"])
    # the window changed what layer 0 computes: these are not the unwindowed model's tokens
    assert r["offload"] != [t[:12] for t in decoder_results["float32"]["one_device"]["tokens"]]


def test_offload_decoder_serves_two_models_in_two_threads(decoder_results):
    """Two models of one architecture share the cached offload step: decoding in two threads at
    once, each run gives its own model's tokens (a step that kept the last model's weights in its
    fields swapped them under the other thread: wrong tokens, or a half-made plan's crash)."""
    alone, threaded = decoder_results["threads"]["alone"], decoder_results["threads"]["threaded"]
    assert alone[0] != alone[1]  # the two models' weights differ, and so do their tokens
    for i in range(2):
        assert threaded[i] == [alone[i]] * 3


def test_offload_step_holds_no_weights(decoder_results):
    """Once the caller drops a model decoded by the offload step, its parameter arrays are freed
    (on a GPU, accelerator memory): the step in the compiled-programs cache holds no weights."""
    alive, total = decoder_results["weights_alive_after_del"]
    assert total > 0 and alive == 0


def test_offload_is_not_chosen_on_a_cpu_backend(decoder_results):
    assert decoder_results["auto_on_cpu"] == "magicpig (host op)"


def test_accelerator_check_e2e_with_two_devices(tmp_path):
    # The end-to-end mode (the accelerator script of #8) with cpu:1 forced as the host, on a random
    # 2-layer GGUF (its layer 1 is sparse): it decodes dense and MagicPIG (offloaded) at B = 1 and 2
    # and writes their throughput and agreement. The script's default model, the embedded one, is
    # what it runs on a device; here the model only has to carry the offload path.
    gguf = tmp_path / "tiny.gguf"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_random_gguf.py"), str(gguf), "--shape", "tiny",
                    "--layout", "Q8_0"], check=True, capture_output=True, timeout=120)
    env = _env() | {"XLA_FLAGS": with_test_flag("--xla_force_host_platform_device_count=2")}
    out = tmp_path / "e2e"
    cmd = [sys.executable, str(ROOT / "examples" / "accelerator_check.py"), "--e2e", "--model", str(gguf),
           "--context", "300", "--batches", "1", "2", "--steps", "3", "--repeats", "3", "--host-device", "1",
           "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["batch"] for r in data["results"]] == [1, 2]
    for r in data["results"]:
        assert "offload" in r["magicpig"]["runs_on"] and r["dense"]["runs_on"] == "dense"
        assert r["magicpig"]["tokens_per_s"]["median"] > 0 and len(r["magicpig"]["tokens_per_s"]["values"]) == 3
        dense, sampled = r["dense"]["tokens"], r["magicpig"]["tokens"]
        assert len(dense) == len(sampled) == 4
        assert r["tokens_equal_to_dense"] == sum(a == b for a, b in zip(dense, sampled, strict=True))
    assert "tokens equal to dense" in proc.stdout
    # The offloaded decode samples the keys the single-computation pure-JAX reference samples.
    assert data["results"][0]["tokens_equal_to_reference"] == 4


def test_packed_transfers_return_the_same_bits():
    """The offload step moves q, codes, k, v (and out, lse, end) as one uint32 array each way:
    unpacking gives back every value bit for bit (bfloat16 widened to float32 exactly), for values
    NumPy draws independently, infinities and signed zeros included."""
    import jax.numpy as jnp
    import numpy as np

    from magicpig_jax.offload_decoder import _down_layout, _pack, _unpack, _up_layout

    rng = np.random.default_rng(3)
    B, Hq, Hkv, D, L = 3, 6, 2, 8, 5
    q = rng.standard_normal((B, Hq, D)).astype(np.float32)
    q[0, 0, :3] = [np.inf, -0.0, 1e-42]  # an infinity, a signed zero, a subnormal
    codes = rng.integers(0, 2**32, (B, Hq, L), dtype=np.uint64).astype(np.uint32)
    k = rng.standard_normal((B, Hkv, D)).astype(jnp.bfloat16)
    v = rng.standard_normal((B, Hkv, D)).astype(np.float32)
    packed = _pack(jnp.asarray(q), jnp.asarray(codes), jnp.asarray(k), jnp.asarray(v))
    assert packed.dtype == jnp.uint32 and packed.shape == (B, Hq * (D + L) + 2 * Hkv * D)
    q2, codes2, k2, v2 = (np.asarray(a) for a in _unpack(packed, _up_layout(Hq, Hkv, D, L)))
    assert q2.view(np.uint32).tolist() == q.view(np.uint32).tolist()
    assert codes2.tolist() == codes.tolist()
    assert k2.dtype == np.float32 and k2.tolist() == np.asarray(k, np.float32).tolist()
    assert v2.view(np.uint32).tolist() == v.view(np.uint32).tolist()

    out = rng.standard_normal((B, Hq, D)).astype(np.float32)
    lse = np.array([[-np.inf] * Hq, [0.5] * Hq, [1e30] * Hq], np.float32)
    end = np.array([0, 7, 2**31 - 1], np.int32)
    down = _pack(jnp.asarray(out), jnp.asarray(lse), jnp.asarray(end))
    out2, lse2, end2 = (np.asarray(a) for a in _unpack(down, _down_layout(Hq, D)))
    assert out2.view(np.uint32).tolist() == out.view(np.uint32).tolist()
    assert lse2.tolist() == lse.tolist() and end2.dtype == np.int32 and end2.tolist() == end.tolist()
    # Nothing that would lose bits is packed, and a layout must cover the whole array.
    with pytest.raises(TypeError, match="float64|int64|int8"):
        _pack(jnp.asarray(out), jnp.zeros((B, 2), jnp.int8))
    with pytest.raises(ValueError, match="covers"):
        _unpack(down, _down_layout(Hq, D)[:2])
