"""The README's user paths, with values asserted (tests/test_readme.py checks that each block runs).

* ``magicpig_jax.generate()`` (the README's first Python example) equals greedy decoding by full
  forwards, and a prompt this short samples nothing;
* the default ``magicpig-jax generate`` answers the demo question identically with MagicPIG and
  dense attention;
* ``--kv-dtype`` and sampling through the CLI give the Python API's tokens for the same settings;
* ``bench attention`` reports sizes that follow from its shapes, and a sampled fraction in range;
* ``bench decode`` on a tiny model decodes the greedy tokens of full forwards with both methods;
* ``study attention --capture-from-model`` captures the model's own q/k/v (prefill cache and the
  next decode query).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import magicpig_jax
from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.generation import encode_prompt, forward_logits
from tests._xla import default_level

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
TINY_MODEL = ROOT / "tests" / "fixtures" / "families" / "llama3"  # a tiny random Llama-3-style HF directory


def _cli(*args: str, cwd: Path, timeout: int = 600, long_program: bool = False) -> str:
    env = dict(os.environ, TQDM_DISABLE="1", PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if long_program:  # XLA's default code generation: the program runs long enough to pay for it
        env = default_level(env)
    proc = subprocess.run([str(BIN / "magicpig-jax"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def _greedy(model, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids``, each from a full forward over everything before it."""
    out: list[int] = []
    for _ in range(n):
        out.append(int(np.argmax(forward_logits(model, ids + out)[-1])))
    return out


@pytest.fixture(scope="module")
def model():
    return magicpig_jax.load_model()


def test_python_generate_equals_greedy_full_forwards(model):
    prompt = "Name three colors."
    out = magicpig_jax.generate(model, prompt, attention="magicpig", max_new_tokens=8,
                                config=MagicPIGConfig(K=10, L=150), temperature=0.0)
    ids = encode_prompt(model, prompt, True, False)
    # each generated token is the argmax of a full forward over everything before it (one forward,
    # teacher-forced with the generated tokens: it agrees at every position iff they are the greedy ones)
    logits = np.asarray(forward_logits(model, ids + out.token_ids[:-1]))
    assert out.token_ids == [int(t) for t in np.argmax(logits[len(ids) - 1:], axis=-1)]
    assert len(out.token_ids) == 8 or out.stop_reason == "eos"
    assert out.text == model.tokenizer.decode(out.token_ids)
    assert out.stats["attention"] == "magicpig"
    # every key is a sink or local (README: "its sampled fraction is 0")
    assert len(ids) <= 4 + 64 and out.stats["sampled_fraction"] == 0


def test_cli_default_generate_answers_identically(tmp_path):
    # The demo: the bundled LGPL-2.1 text and its question, MagicPIG then dense from one prefill.
    out = _cli("generate", "--max-new-tokens", "24", "--json", "demo.json", cwd=tmp_path, timeout=900,
               long_program=True)
    assert "answers identical across backends: yes" in out
    results = json.loads((tmp_path / "demo.json").read_text())["results"]
    assert set(results) == {"magicpig", "dense"}
    assert results["magicpig"]["token_ids"] == results["dense"]["token_ids"]
    assert "Yoyodyne" in results["magicpig"]["text"]
    assert 0 < results["magicpig"]["sampled_fraction"] < 0.2  # 5,900 tokens: sampled, not all


def test_cli_sampling_and_kv_dtype_equal_the_python_api(model, tmp_path):
    prompt = "Write a haiku about hashing."
    kw = dict(attention="dense", max_new_tokens=12, temperature=0.9, top_p=0.95, seed=3)
    api = {d: magicpig_jax.generate(model, prompt, kv_dtype=d, **kw).token_ids for d in ("float32", "bfloat16")}
    # the bfloat16 cache changes the sampled tokens here, so the CLI's --kv-dtype is observable: the
    # CLI's run with float32 (not its default bfloat16) equals the API's float32 run, not its bfloat16 one
    assert api["float32"] != api["bfloat16"]
    _cli("generate", "--prompt", prompt, "--attention", "dense", "--max-new-tokens", "12", "--temperature", "0.9",
         "--top-p", "0.95", "--seed", "3", "--kv-dtype", "float32", "--json", "f32.json", cwd=tmp_path)
    assert json.loads((tmp_path / "f32.json").read_text())["results"]["dense"]["token_ids"] == api["float32"]
    # sampling, not greedy: another seed gives other tokens
    assert magicpig_jax.generate(model, prompt, kv_dtype="float32", **(kw | {"seed": 4})).token_ids != api["float32"]


def test_cli_bench_decode_tiny_model_decodes_greedy_tokens(tmp_path):
    _cli("bench", "decode", "--model", str(TINY_MODEL), "--lengths", "40", "--steps", "4", "--repeats", "3",
         "--warmup", "0", "--out", "runs/bd", cwd=tmp_path)
    rows = json.loads((tmp_path / "runs" / "bd.json").read_text())["results"]
    assert {r["method"] for r in rows} == {"dense", "magicpig"}
    tiny = magicpig_jax.load_model(str(TINY_MODEL))
    from magicpig_jax.eval.bench_decode import DEFAULT_TEXT, prompt_ids

    ids = prompt_ids(tiny, DEFAULT_TEXT.read_text(encoding="utf-8"), 40)
    want = _greedy(tiny, ids, 5)  # the first token (from the prefill) and 4 decode steps
    for r in rows:
        assert r["prompt_tokens"] == 40 and r["rows_identical"]
        assert r["tokens"] == want, r["method"]  # 40 <= 4 + 64: MagicPIG keeps every key, equals dense
        assert r["ms_per_step"]["median"] > 0 and len(r["ms_per_step"]["values"]) == 3


def test_study_capture_from_model_captures_the_models_qkv(model, tmp_path):
    from magicpig_jax.eval import study
    from magicpig_jax.generation import prefill

    text = tmp_path / "text.txt"
    text.write_text("MagicPIG samples keys with locality-sensitive hashing. " * 12)
    out = tmp_path / "out"
    assert study.main(["--capture-from-model", "--capture-text", str(text), "--no-synthetic", "--layers", "0,15",
                       "--fractions", "0.5", "--lsh", "4x10", "--repeats", "1", "--num-local", "8", "--no-plot",
                       "--out", str(out)]) == 0
    cap = np.load(out / "capture.npz")
    ids = model.tokenizer.encode(text.read_text())
    N, cfg = len(ids), model.config
    assert int(cap["num_tokens"]) == N
    assert cap["q"].shape == (cfg.num_layers, cfg.num_heads, cfg.head_dim)
    assert cap["k"].shape == cap["v"].shape == (cfg.num_layers, cfg.num_kv_heads, N, cfg.head_dim)
    state = prefill(model, [ids], 1)  # the cache the capture must hold
    for layer in (0, 15, cfg.num_layers - 1):
        np.testing.assert_allclose(cap["k"][layer], np.asarray(state.cache.k[layer][0, :, :N]), rtol=0, atol=1e-5)
        np.testing.assert_allclose(cap["v"][layer], np.asarray(state.cache.v[layer][0, :, :N]), rtol=0, atol=1e-5)
    assert np.isfinite(cap["q"]).all() and np.abs(cap["q"]).max() > 0
    result = json.loads((out / "study.json").read_text())
    assert {r["case"] for r in result["records"]} == {"layer0", "layer15"}
    assert all(r["source"] == "capture" for r in result["records"])
    topk = [r for r in result["records"] if r["method"] == "topk"]
    assert len(topk) == 2 and all(r["fraction"] == pytest.approx(np.ceil(0.5 * N) / N) for r in topk)
