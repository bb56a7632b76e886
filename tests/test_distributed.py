"""magicpig_jax.distributed: MagicPIG with the batch and the KV heads sharded over 8 devices.

The devices are 8 virtual CPU devices, which needs ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
before JAX initializes; so the checks run in one subprocess (``_CHECKS`` below) that
reports a JSON dict, and each test asserts on its part. The sharded results must equal
the single-device host op: exactly for the index and ``num_sampled``, to ~1e-6 for
``out``/``lse``; the compiled programs must hold no collective (nothing is gathered).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests._xla import with_test_flag

_CHECKS = textwrap.dedent(r'''
    import json, os, traceback
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from magicpig_jax import host, distributed as dist
    from magicpig_jax.attention import MagicPIGConfig, build_lsh_index, magicpig_attention

    R = {"devices": len(jax.devices())}
    B, Hq, Hkv, N, D = 8, 16, 8, 300, 16
    CAP = 320
    cfg = MagicPIGConfig(K=6, L=20, num_sink=3, num_local=8)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, D), np.float32)
    k = rng.standard_normal((B, Hkv, N, D), np.float32) + np.float32(0.5)
    v = rng.standard_normal((B, Hkv, N, D), np.float32)
    proj = rng.standard_normal((D, cfg.K * cfg.L), np.float32)
    lengths = np.array([300, 250, 17, 120, 0, 2, 299, 64], np.int32)
    k_new = rng.standard_normal((B, Hkv, 12, D), np.float32) + np.float32(0.5)
    counts = np.array([12, 0, 5, 12, 3, 1, 0, 7], np.int32)
    W = 20

    build = jax.jit(host.host_build_index, static_argnames=("config", "capacity"))
    attend = jax.jit(host.host_magicpig_attention, static_argnames=("config", "static_window"))
    append = jax.jit(host.host_append)
    ref_index = build(jnp.asarray(k), jnp.asarray(proj), cfg, jnp.asarray(lengths), capacity=CAP)
    ref = [np.asarray(x) for x in attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), ref_index, cfg,
                                         jnp.asarray(lengths), static_window=W)]
    ref_appended = append(ref_index, jnp.asarray(k_new), jnp.asarray(counts))
    FIELDS = ("ids", "offsets", "open_codes", "bounds", "mean", "projections")

    def index_equal(a, b):
        return all(np.array_equal(np.asarray(getattr(a, f)), np.asarray(getattr(b, f))) for f in FIELDS)

    def compare(got, want):
        out, lse, ns = (np.asarray(x) for x in got)
        fin = np.isfinite(want[1])
        return {
            "ns_equal": bool(np.array_equal(ns, want[2])),
            "out_diff": float(np.max(np.abs(out - want[0]))),
            "lse_diff": float(np.max(np.abs(lse[fin] - want[1][fin]))) if fin.any() else 0.0,
            "lse_inf_equal": bool(np.array_equal(np.isneginf(lse), np.isneginf(want[1]))),
            "any_sampled": bool(ns.sum() > 0),
        }

    def check(name, fn):
        try:
            R[name] = fn()
        except Exception:
            R[name] = {"error": traceback.format_exc()}

    def per_mesh(nb, nh):
        mesh = dist.make_mesh(batch=nb, kv_heads=nh)
        ks, vs, qs = dist.shard_kv(mesh, k), dist.shard_kv(mesh, v), dist.shard_q(mesh, q)
        ls = dist.shard_rows(mesh, lengths)
        index = dist.sharded_build_index(mesh, ks, proj, cfg, ls, capacity=CAP)
        res = {"index_equal": index_equal(index, ref_index)}
        got = dist.sharded_magicpig_attention(mesh, qs, ks, vs, index, cfg, ls, static_window=W)
        res.update(compare(got, ref))
        out = got[0]
        res["out_spec"] = list(out.sharding.spec)
        res["out_shard_shapes"] = sorted({tuple(s.data.shape) for s in out.addressable_shards})
        res["out_shards"] = len(out.addressable_shards)
        res["ids_shard_shapes"] = sorted({tuple(s.data.shape) for s in index.ids.addressable_shards})
        # Appending generated keys on every shard (the index is donated) equals the single-device append.
        appended = dist.sharded_append(mesh, index, dist.shard_kv(mesh, k_new), dist.shard_rows(mesh, counts))
        res["append_equal"] = index_equal(appended, ref_appended)
        # No collective in any compiled program: each device works on its own shard only.
        texts = [
            dist._attention.lower(qs, ks, vs, appended, ls, mesh=mesh, config=cfg, static_window=W, impl="auto",
                                  max_threads=0).compile().as_text(),
            dist._build.lower(ks, jnp.asarray(proj), ls, mesh=mesh, config=cfg, capacity=CAP,
                              open_capacity=host.DEFAULT_OPEN_CAPACITY, chunk_size=None,
                              max_threads=0).compile().as_text(),
        ]
        ops = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
        res["collectives"] = sorted({op for t in texts for op in ops if op in t})
        return res

    for nb, nh in ((2, 4), (8, 1), (1, 8), (4, 2)):
        check(f"mesh_{nb}x{nh}", lambda nb=nb, nh=nh: per_mesh(nb, nh))

    def against_pure_jax():
        # The sharded host op also equals the pure-JAX reference (same sampled sets).
        mesh = dist.make_mesh(batch=2, kv_heads=4)
        ks, vs = dist.shard_kv(mesh, k), dist.shard_kv(mesh, v)
        index = dist.sharded_build_index(mesh, ks, proj, cfg, lengths, capacity=CAP)
        got = dist.sharded_magicpig_attention(mesh, jnp.asarray(q), ks, vs, index, cfg, lengths, static_window=W)
        ri = build_lsh_index(jnp.asarray(k), jnp.asarray(proj), cfg, jnp.asarray(lengths))
        want = [np.asarray(x) for x in magicpig_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), ri, cfg,
                                                          jnp.asarray(lengths))]
        return compare(got, want)

    check("pure_jax", against_pure_jax)

    def inside_jit():
        # Composable: the sharded step inside a user's jit, with bfloat16 caches and default lengths.
        mesh = dist.make_mesh(batch=2, kv_heads=4)
        kb, vb = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
        ks, vs = dist.shard_kv(mesh, kb), dist.shard_kv(mesh, vb)
        index = dist.sharded_build_index(mesh, ks, proj, cfg)

        @jax.jit
        def step(q, ks, vs, index):
            out, lse, ns = dist.sharded_magicpig_attention(mesh, q, ks, vs, index, cfg)
            return out * 2.0, lse, ns

        out, lse, ns = step(dist.shard_q(mesh, q), ks, vs, index)
        ri = build(kb, jnp.asarray(proj), cfg, None)
        want = [np.asarray(x) for x in attend(jnp.asarray(q), kb, vb, ri, cfg, None)]
        return compare((out / 2.0, lse, ns), want)

    check("inside_jit", inside_jit)

    def committed():
        # arrays committed to one device (not placed with shard_kv) are moved to their shards
        mesh = dist.make_mesh(batch=2, kv_heads=4)
        dev = jax.devices()[0]
        kc, vc, qc, pc, lc = jax.device_put((k, v, q, proj, lengths), dev)
        index = dist.sharded_build_index(mesh, kc, pc, cfg, lc, capacity=CAP)
        got = dist.sharded_magicpig_attention(mesh, qc, kc, vc, index, cfg, lc, static_window=W)
        return compare(got, ref) | {"index_equal": index_equal(index, ref_index)}

    check("committed", committed)

    def overflow(mesh):
        # global row 6 (the second shard's row 2), hashed to 291 of 320 positions: 12 keys fit twice, not thrice
        index = dist.sharded_build_index(mesh, dist.shard_kv(mesh, k), proj, cfg, lengths, capacity=CAP)
        six = np.array([0, 0, 0, 0, 0, 0, 12, 0], np.int32)
        for _ in range(3):
            index = dist.sharded_append(mesh, index, dist.shard_kv(mesh, k_new), six)

    def errors():
        out = {}
        mesh = dist.make_mesh(batch=2, kv_heads=4)
        cases = {
            "batch_split": lambda: dist.sharded_build_index(mesh, k[:3], proj, cfg),
            "head_split": lambda: dist.sharded_build_index(mesh, k[:, :6], proj, cfg),
            "bad_mesh": lambda: dist.sharded_build_index(jax.make_mesh((8,), ("x",)), k, proj, cfg),
            "too_many": lambda: dist.make_mesh(batch=4, kv_heads=4),
            "repeated": lambda: dist.make_mesh(batch=2, kv_heads=2, devices=jax.devices()[:3] + jax.devices()[:1]),
            "lengths": lambda: dist.sharded_build_index(mesh, k, proj, cfg, np.full(B, N + 1, np.int32)),
            "gqa": lambda: dist.sharded_magicpig_attention(mesh, q[:, :12], k, v, ref_index, cfg),
            "q_dim": lambda: dist.sharded_magicpig_attention(mesh, q[..., :8], k, v, ref_index, cfg),
            "q_rows": lambda: dist.sharded_magicpig_attention(mesh, q[:4], k, v, ref_index, cfg),
            "v_shape": lambda: dist.sharded_magicpig_attention(mesh, q, k, v[:, :, :10], ref_index, cfg),
            "overflow": lambda: overflow(mesh),
        }
        for name, fn in cases.items():
            try:
                fn()
                out[name] = "no error"
            except ValueError as e:
                out[name] = "ValueError: " + str(e)
        return out

    check("errors", errors)
    print("RESULT " + json.dumps(R))
''')


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ)
    env["XLA_FLAGS"] = with_test_flag()  # the script adds its device count
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", _CHECKS], capture_output=True, text=True, env=env, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"subprocess failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def _ok(res: dict, name: str) -> dict:
    r = res[name]
    assert "error" not in r, r.get("error")
    return r


def _assert_equal_results(r: dict, tol: float = 1e-6) -> None:
    assert r["ns_equal"]
    assert r["lse_inf_equal"]
    assert r["out_diff"] <= tol and r["lse_diff"] <= tol, r
    assert r["any_sampled"]


def test_eight_virtual_devices(results):
    assert results["devices"] == 8


@pytest.mark.parametrize("mesh", ["2x4", "8x1", "1x8", "4x2"])
def test_sharded_equals_single_device(results, mesh):
    r = _ok(results, f"mesh_{mesh}")
    assert r["index_equal"]
    _assert_equal_results(r)
    assert r["append_equal"]


@pytest.mark.parametrize("mesh", ["2x4", "8x1", "1x8", "4x2"])
def test_each_device_holds_its_shard_and_nothing_is_gathered(results, mesh):
    r = _ok(results, f"mesh_{mesh}")
    nb, nh = (int(x) for x in mesh.split("x"))
    B, Hq, Hkv, D, L = 8, 16, 8, 16, 20
    assert r["out_spec"] == ["batch", "kv_heads", None]
    assert r["out_shards"] == 8
    assert r["out_shard_shapes"] == [[B // nb, Hq // nh, D]]  # the G query heads of each local KV head
    assert r["ids_shard_shapes"] == [[B // nb, Hkv // nh, 1, L, 320]]
    assert r["collectives"] == []


def test_sharded_equals_pure_jax_reference(results):
    _assert_equal_results(_ok(results, "pure_jax"), tol=2e-5)


def test_sharded_inside_jit_bfloat16(results):
    _assert_equal_results(_ok(results, "inside_jit"))


def test_errors_name_the_problem(results):
    e = _ok(results, "errors")
    assert "B=3" in e["batch_split"] and "'batch'" in e["batch_split"]
    assert "Hkv=6" in e["head_split"]
    assert "('batch', 'kv_heads')" in e["bad_mesh"]
    assert "needs 16 devices" in e["too_many"]
    # a device twice in one mesh failed later with a bare AssertionError inside jax.device_put
    assert "devices must be distinct" in e["repeated"] and "cpu:0" in e["repeated"]
    # the host op inside the shard_map saw the second shard's rows only and named this row 2
    assert e["overflow"] == ("ValueError: appending 12 keys to row 6 at position 315 exceeds the index capacity "
                             "320")
    assert "lengths must be in [0, 300]" in e["lengths"]
    assert "multiple of Hkv" in e["gqa"]
    # these named per-device shapes ("q (1, 4, 16) and k (1, 1, 512, 32) disagree") or JAX's own split error
    assert "q must be [B, Hq, D] with k's B = 8 and D = 16, got (8, 16, 8)" in e["q_dim"]
    assert "q must be [B, Hq, D] with k's B = 8 and D = 16, got (4, 16, 16)" in e["q_rows"]
    assert "v must have k's shape [B, Hkv, N, D] = (8, 8, 300, 16), got (8, 8, 10, 16)" in e["v_shape"]


def test_arrays_committed_to_one_device_are_moved_to_their_shards(results):
    """The docstring promised it; a committed k raised JAX's 'incompatible devices'."""
    r = _ok(results, "committed")
    assert r["index_equal"]
    _assert_equal_results(r)


_DECODE_CHECK = r"""
import dataclasses, json
import jax, numpy as np
from magicpig_jax import distributed as dist
from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.eval.forcing import forced_decode
from magicpig_jax.generation import prefill
from tests._tiny import TINY, tiny_model

assert len(jax.devices()) == 8
model = tiny_model(0)
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 97, n).tolist() for n in (300, 250, 200, 290)]
state = prefill(model, prompts, 12)
cfg = MagicPIGConfig(K=6, L=20, num_sink=2, num_local=8)
mesh = dist.make_mesh(batch=4, kv_heads=2)
logits1, logits8 = [], []
kw = dict(attention="magicpig", max_new_tokens=12, config=cfg, dense_layers=(0,), stop_on_eos=False)
out1, st1 = forced_decode(model, state, logits_callback=lambda t, l: logits1.append(l), **kw)
out8, st8 = forced_decode(model, state, mesh=mesh, logits_callback=lambda t, l: logits8.append(l), **kw)
# one SimHash matrix per group of layers (SharedProjections states) on the mesh too
model4 = tiny_model(0, dataclasses.replace(TINY, num_layers=4))
state4 = prefill(model4, prompts, 12)
kw4 = dict(kw, config=dataclasses.replace(cfg, layers_per_projection=4))
out4, st4 = forced_decode(model4, state4, **kw4)
out48, st48 = forced_decode(model4, state4, mesh=mesh, **kw4)
# each sharded step compiled once: its first inputs are placed as its outputs are
from magicpig_jax.models import decoding
mesh_compiles = [fn.jitted._cache_size() for key, fn in decoding._STEP_CACHE.items() if key[2].mesh is not None]
# 3 rows over the 4 devices of the 'batch' axis: the decode's own error, not JAX's IndivisibleError
try:
    forced_decode(model, prefill(model, prompts[:3], 12), mesh=mesh, **kw)
    split_error = None
except ValueError as err:
    split_error = str(err)
print(json.dumps({"mesh_compiles": mesh_compiles, "split_error": split_error,
                  "same_tokens": out1 == out8, "max_dlogit": float(np.abs(np.array(logits1) - np.array(logits8)).max()),
                  "frac1": st1["sampled_fraction"], "frac8": st8["sampled_fraction"],
                  "shared_same": out4 == out48 and st4["sampled_fraction"] == st48["sampled_fraction"]}))
"""


def _run_on_devices(script: str, devices: int) -> dict:
    """``script``'s last line of JSON, run in a process with ``devices`` virtual CPU devices."""
    env = dict(os.environ, XLA_FLAGS=with_test_flag(f"--xla_force_host_platform_device_count={devices}"),
               JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_full_model_decode_sharded_over_8_devices_equals_one_device():
    r = _run_on_devices(_DECODE_CHECK, 8)
    assert r["same_tokens"]
    assert r["max_dlogit"] < 1e-4
    assert r["frac1"] == r["frac8"] and 0 < r["frac1"] < 1
    assert r["shared_same"]
    assert r["split_error"] == "batch size B=3 is not divisible by the mesh's 'batch' axis (4 devices)"
    # two sharded decodes (own and shared matrices), each step program compiled once, not twice
    assert r["mesh_compiles"] == [1, 1]


_TWO_PROCESSES = r"""
import json, os, sys
rank, port = int(sys.argv[1]), sys.argv[2]
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax
jax.distributed.initialize(coordinator_address="127.0.0.1:" + port, num_processes=2, process_id=rank)
import numpy as np
from jax.sharding import NamedSharding
from magicpig_jax import distributed as dist, host
from magicpig_jax.attention import MagicPIGConfig

B, Hq, Hkv, N, D = 2, 4, 2, 64, 16
cfg = MagicPIGConfig(K=6, L=20, num_sink=3, num_local=8)
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal(s, np.float32) for s in ((B, Hq, D), (B, Hkv, N, D), (B, Hkv, N, D)))
proj = rng.standard_normal((D, cfg.K * cfg.L), np.float32)
lengths = np.array([64, 40], np.int32)
mesh = dist.make_mesh(batch=2, kv_heads=2)  # this process's row on its two devices
local = lambda x, spec: jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x[rank:rank + 1])
kg, vg, qg, lg = local(k, dist.KV_SPEC), local(v, dist.KV_SPEC), local(q, dist.Q_SPEC), local(lengths, dist.ROW_SPEC)
index = dist.sharded_build_index(mesh, kg, proj, cfg, lg, capacity=64)
out, lse, ns = dist.sharded_magicpig_attention(mesh, qg, kg, vg, index, cfg, lg)
ref = np.asarray(host.host_magicpig_attention(q, k, v, host.host_build_index(k, proj, cfg, lengths, capacity=64),
                                              cfg, lengths)[0])
print("RESULT " + json.dumps({"rows": sorted({s.index[0].start for s in out.addressable_shards}),
                              "max_diff": max(float(np.abs(np.asarray(s.data) - ref[s.index]).max())
                                              for s in out.addressable_shards)}))
"""


def test_two_processes_with_process_local_rows():
    """The module docstring's multi-process use: lengths made with make_array_from_process_local_data
    are not addressable here, and checking their values with np.asarray raised."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = dict(os.environ) | {"XLA_FLAGS": with_test_flag(), "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-c", _TWO_PROCESSES, str(rank), port], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    try:  # one process failing (e.g. its port taken meanwhile) leaves the other waiting: kill both
        outs = [p.communicate(timeout=120) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        outs = [p.communicate() for p in procs]
        pytest.fail("the two processes did not finish in 120 s; their stderr:\n"
                    + "\n".join(e[-2000:] for _, e in outs))
    for p, (out, _) in zip(procs, outs, strict=True):
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, "\n".join(e[-2000:] for _, e in outs)
    results = [json.loads([ln for ln in out.splitlines() if ln.startswith("RESULT ")][-1][7:]) for out, _ in outs]
    assert [r["rows"] for r in results] == [[0], [1]]  # each process computed its own row
    assert all(r["max_diff"] < 1e-5 for r in results), results


_MESH_SHAPES_CHECK = r"""
import glob, json, os, re, sys, tempfile
dump = tempfile.mkdtemp()
os.environ["XLA_FLAGS"] += f" --xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_pass_re=NONE"
import jax, numpy as np
from magicpig_jax import distributed as dist
from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.generation import decode, prefill
from magicpig_jax.models import decoding
from tests._tiny import tiny_model

model = tiny_model(0)  # Hkv 2
rng = np.random.default_rng(0)
prompts = [rng.integers(0, 97, n).tolist() for n in (50, 30, 20, 40)]
state = prefill(model, prompts, 4)
kw = dict(attention="magicpig", max_new_tokens=4, stop_on_eos=False, dense_layers=(0,),
          config=MagicPIGConfig(K=6, L=20, num_sink=2, num_local=8))
ref, _ = decode(model, state, **kw)
res = {}
for nb, nh in ((2, 2), (4, 1), (1, 2)):
    before = set(glob.glob(f"{dump}/*"))
    decoding._STEP_CACHE.clear()
    out, _ = decode(model, state, mesh=dist.make_mesh(batch=nb, kv_heads=nh, devices=jax.devices()[:nb * nh]), **kw)
    texts = [open(f).read() for f in set(glob.glob(f"{dump}/*jit_step*after_optimizations.txt")) - before]
    res[f"{nb}x{nh}"] = {"same": out == ref, "programs": len(texts),
                         "compiles": [fn.jitted._cache_size() for _, fn in decoding._STEP_CACHE.items()],
                         "gathers": sum(len(re.findall(r" all-gather\(", t)) for t in texts)}
print(json.dumps(res))
"""


def test_a_sharded_decode_step_gathers_no_cache_and_compiles_once_on_any_mesh_shape():
    """The per-row cache write all-gathered every layer's K and V over the batch axis in each step
    (each device held the whole batch's cache as a temporary), and a mesh with an axis of size 1
    compiled the step twice (its outputs' specs dropped that axis, its first inputs kept it)."""
    for mesh, r in _run_on_devices(_MESH_SHAPES_CHECK, 4).items():
        assert r["same"] and r["compiles"] == [1] and r["programs"] >= 1 and r["gathers"] == 0, (mesh, r)


def test_make_mesh_takes_numpy_integers_and_names_the_devices_kv_heads_needs():
    import jax
    import numpy as np

    from magicpig_jax import distributed as dist

    mesh = dist.make_mesh(batch=np.int32(1), kv_heads=np.int64(1))
    assert dict(mesh.shape) == {"batch": 1, "kv_heads": 1}
    n = len(jax.devices())
    with pytest.raises(ValueError, match=f"kv_heads={n + 1} needs at least {n + 1} devices, have {n}"):
        dist.make_mesh(kv_heads=n + 1)
    with pytest.raises(ValueError, match="kv_heads must be a positive int"):
        dist.make_mesh(kv_heads=np.bool_(True))
