"""The scripts of the GPU runs (``tools/gpu_check.sh``, ``tools/offload_phases.py``), run on a CPU.

A session that is lent a GPU has minutes of device time: a script that breaks there wastes them.
So the suite runs both here with small shapes and a tiny random-weight GGUF
(``tools/make_random_gguf.py``): the accelerator is the CPU itself for ``gpu_check.sh``, and
cpu:0 stands in for it (two virtual CPU devices) for ``offload_phases.py``. The figures are not
checked (timings on a CPU say nothing about a GPU); what is checked is that every step runs,
that the offloaded layer agrees with the host op, and that each output holds what the docs
(docs/benchmarks.md, "On a GPU") read from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._xla import with_test_flag

ROOT = Path(__file__).resolve().parent.parent
SMALL = "--batch 2 --q-heads 4 --kv-heads 2 --head-dim 16 --context 512"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    subprocess.run([sys.executable, str(ROOT / "tools" / "make_random_gguf.py"), str(path), "--shape", "tiny",
                    "--layout", "Q8_0"], check=True, capture_output=True, timeout=120)
    return path


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(ROOT), XLA_FLAGS=with_test_flag(extra.pop("XLA_FLAGS", "")), **extra)
    return env


@pytest.mark.slow
def test_gpu_check_script_runs_every_check(tmp_path, tiny_gguf):
    out = tmp_path / "gpu"
    p = subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), str(out), str(tiny_gguf)], cwd=tmp_path,
                       env=_env(PYTHON=sys.executable, CHECK_ARGS=SMALL,
                                E2E_ARGS="--context 160 --steps 3 --repeats 1 --batches 1 2"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "jax" in (out / "machine.txt").read_text()
    synthetic = (out / "synthetic.log").read_text()
    assert "offloaded result matches host-only: OK" in synthetic
    assert "same sampled sets as host-only: 100.00% of heads" in synthetic
    assert "separate computations on the CPU device:" in (out / "mechanisms.log").read_text()
    e2e = json.loads((out / "e2e.json").read_text())
    assert [r["batch"] for r in e2e["results"]] == [1, 2]
    for r in e2e["results"]:
        for m in ("dense", "magicpig"):
            assert r[m]["tokens_per_s"]["median"] > 0 and len(r[m]["tokens"]) == 4
    # On a CPU MagicPIG runs the host op in the jitted step; it samples the keys the reference does.
    assert e2e["results"][0]["tokens_equal_to_reference"] == 4


@pytest.mark.slow
def test_offload_phases_times_each_phase_and_profiles_the_decoder(tmp_path, tiny_gguf):
    out, prof = tmp_path / "phases.json", tmp_path / "profile.txt"
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "offload_phases.py"), "--out", str(out), "--shapes",
                        "tiny", "--reps", "2", "--decode", str(tiny_gguf), "--context", "160", "--steps", "3",
                        "--profile", str(prof)], cwd=tmp_path,
                       env=_env(XLA_FLAGS="--xla_force_host_platform_device_count=2"),
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert (res["accelerator"], res["host"]) == ("cpu:0", "cpu:1")
    layer = res["layers"]["tiny"]
    assert layer["shape"] == {"B": 2, "Hq": 4, "Hkv": 2, "N": 512, "D": 16, "K": 10, "L": 150}
    for phase in ("accelerator_part", "to_host_q_codes", "host_op", "to_accelerator_out_lse", "merge",
                  "whole_layer", "empty_jit_accelerator", "empty_jit_host"):
        assert layer[phase] > 0, phase
    assert layer["bytes_to_host"] == 2 * 4 * (16 + 150) * 4  # q float32 and codes uint32
    assert layer["bytes_to_accelerator"] == 2 * 4 * (16 + 1) * 4  # out and lse, float32
    dec = res["decode"]
    assert dec["profiled_yields"] == 3 and dec["runs_on"].startswith("magicpig (offload")
    assert "offload_decoder.py" in prof.read_text()
