"""Sliding-window attention (Mistral ``sliding_window``, Qwen2 ``use_sliding_window``) against
transformers and float64 NumPy: prefill, decode (pure JAX and the host op), the choice of dense
layers under a sparse backend, GGUF and orbax checkpoints.

``fixtures/families/{mistral,qwen2}_window_logits.npz`` are transformers' logits and greedy
continuation of the families' checkpoints with a window of 8 (every Mistral layer; Qwen2's
second layer only), written by ``fixtures/make_families.py window``.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magicpig_jax.attention import dense_attention
from magicpig_jax.eval.forcing import forced_decode
from magicpig_jax.generation import decode, decode_spec, forward_logits, generate, prefill
from magicpig_jax.io.loader import load_model
from magicpig_jax.models.decoding import _causal_block_attention
from tests.fixtures.gguf_convert import write_gguf

FIXTURES = Path(__file__).parent / "fixtures" / "families"
TOLERANCE = 1e-4
CASES = {"mistral_window": "mistral", "qwen2_window": "qwen2", "smollm3_window": "smollm3", "phi3_window": "phi3"}


def _ref(case: str) -> dict:
    return dict(np.load(FIXTURES / f"{case}_logits.npz"))


def _folder(case: str, tmp_path: Path) -> Path:
    """The family's HF directory with the case's config.json changes."""
    ref = _ref(case)
    folder = tmp_path / case
    shutil.copytree(FIXTURES / CASES[case], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(json.loads(str(ref["config_changes"])))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _np_window_attention(q, k, v, q_pos, window):
    """float64 causal attention with GQA where the query at position p sees keys p - W + 1 .. p."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, C, Hq, D = q.shape
    Hkv = k.shape[1]
    out = np.zeros((B, C, Hq, D))
    for b in range(B):
        for c in range(C):
            p = q_pos[c]
            lo = 0 if window is None else max(0, p - window + 1)
            for h in range(Hq):
                s = k[b, h // (Hq // Hkv), lo:p + 1] @ q[b, c, h] / np.sqrt(D)
                e = np.exp(s - s.max())
                out[b, c, h] = e @ v[b, h // (Hq // Hkv), lo:p + 1] / e.sum()
    return out


@pytest.mark.parametrize("window", [None, 1, 3, 4, 5, 9, 100])
def test_prefill_block_attention_matches_float64(window):
    """The prefill's block loop with a window: blocks wholly before the chunk's first window are
    skipped and partly visible ones masked, for windows shorter than, equal to and longer than a
    block (4 keys), at every chunk of a 16-position cache."""
    rng = np.random.default_rng(0)
    B, N, Hq, Hkv, D, C = 2, 16, 4, 2, 8, 4
    k = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    fn = jax.jit(_causal_block_attention, static_argnames=("chunk", "window"))
    for start in range(0, N, C):
        q = rng.standard_normal((B, C, Hq, D)).astype(np.float32) * 2
        got = fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.int32(start), chunk=C, window=window)
        ref = _np_window_attention(q, k, v, list(range(start, start + C)), window)
        np.testing.assert_allclose(np.asarray(got), ref, atol=2e-5, rtol=1e-4)


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 40), st.lists(st.integers(-3, 45), min_size=2, max_size=2),
       st.lists(st.integers(-3, 45), min_size=2, max_size=2), st.integers(0, 2**31 - 1))
def test_dense_attention_starts_matches_float64(n, lengths, starts, seed):
    """``dense_attention(..., starts)`` attends to keys ``starts .. lengths - 1`` (clipped), an empty
    range giving out 0 and lse -inf."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 6, 8)).astype(np.float32)
    k = rng.standard_normal((2, 3, n, 8)).astype(np.float32)
    v = rng.standard_normal((2, 3, n, 8)).astype(np.float32)
    out, lse = dense_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths, jnp.int32),
                               jnp.asarray(starts, jnp.int32))
    for b in range(2):
        end = int(np.clip(lengths[b], 0, n))
        first = int(np.clip(starts[b], 0, n))
        for h in range(6):
            if first >= end:
                assert float(lse[b, h]) == -np.inf and not np.asarray(out[b, h]).any()
                continue
            s = k[b, h // 2, first:end].astype(np.float64) @ q[b, h] / np.sqrt(8)
            e = np.exp(s - s.max())
            np.testing.assert_allclose(np.asarray(out[b, h]), e @ v[b, h // 2, first:end] / e.sum(), atol=2e-5)
            np.testing.assert_allclose(float(lse[b, h]), s.max() + np.log(e.sum()), atol=2e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_logits_match_transformers(case, tmp_path):
    ref = _ref(case)
    model = load_model(_folder(case, tmp_path))
    assert model.config.sliding_window == 8
    logits = forward_logits(model, ref["prompt_ids"].tolist())
    assert float(np.abs(logits - ref["logits"]).max()) <= TOLERANCE
    # the window changes the logits: the checkpoint without it is far off past 8 positions
    full = load_model(FIXTURES / CASES[case])
    assert float(np.abs(forward_logits(full, ref["prompt_ids"].tolist()) - ref["logits"]).max()) > 0.01


@pytest.mark.parametrize("host", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_decode_matches_transformers(case, host, tmp_path):
    """Greedy decoding past the window equals transformers' ``generate``, and every step's logits
    (teacher-forced) equal its logits of the whole sequence: the host op's window (``starts``) and
    the pure-JAX one."""
    ref = _ref(case)
    model = load_model(_folder(case, tmp_path))
    prompt = ref["prompt_ids"].tolist()
    generated = ref["generated"].tolist()
    state = prefill(model, [prompt], len(generated))
    spec = dataclasses.replace(decode_spec(model, "dense", positions=state.cache.capacity), host=host)
    steps = {}
    ids, _ = forced_decode(model, state, forced_tokens=[generated], max_new_tokens=len(generated), spec=spec,
                           stop_on_eos=False, logits_callback=lambda t, x: steps.setdefault(t, x[0].copy()))
    got = np.stack([steps[t] for t in range(len(generated))])
    want = ref["sequence_logits"][len(prompt) - 1:-1]
    assert float(np.abs(got - want).max()) <= TOLERANCE
    tokens, _ = decode(model, state, attention="dense", max_new_tokens=len(generated), stop_on_eos=False)
    assert tokens[0] == generated


def test_sparse_backends_keep_windowed_layers_dense(tmp_path):
    """Under MagicPIG a layer whose window binds decodes exactly over it (added to the dense
    layers); a window as long as the run never binds; a model whose every layer's window binds
    runs no sparse backend (refused, naming it); a hand-made spec that keeps such a layer sparse
    is refused by the step."""
    qwen = load_model(_folder("qwen2_window", tmp_path))
    assert decode_spec(qwen, "magicpig", dense_layers=(), positions=256).dense_layers == (1,)
    assert decode_spec(qwen, "magicpig", dense_layers=(), positions=8).dense_layers == ()
    assert decode_spec(qwen, "topk", dense_layers=(), budget=16).dense_layers == (1,)  # any length
    ref = _ref("qwen2_window")
    prompt = ref["prompt_ids"].tolist()
    state = prefill(qwen, [prompt], 8)
    dense, _ = decode(qwen, state, attention="dense", max_new_tokens=8, stop_on_eos=False)
    # a 36-token prompt lies wholly in MagicPIG's static set (4 sinks + 64 local): it equals dense
    sparse, stats = decode(qwen, state, attention="magicpig", max_new_tokens=8, stop_on_eos=False, dense_layers=())
    assert sparse == dense and stats["dense_layers"] == [1]
    mistral = load_model(_folder("mistral_window", tmp_path))
    with pytest.raises(ValueError, match="every layer of this model attends through a sliding window of 8"):
        decode_spec(mistral, "magicpig", positions=256)
    with pytest.raises(ValueError, match="every layer of this model attends through a sliding window of 8"):
        generate(mistral, "The license", attention="magicpig", max_new_tokens=2, chat=False)
    spec = decode_spec(qwen, "magicpig", dense_layers=(), positions=8)  # as if the run fit the window
    with pytest.raises(ValueError, match=r"layers \[1\] attend through a sliding window of 8 tokens"):
        forced_decode(qwen, state, spec=spec, max_new_tokens=2)


def test_gguf_and_checkpoint_keep_the_window(tmp_path):
    """A GGUF's ``attention.sliding_window`` windows every layer (it names no layer); an orbax
    checkpoint keeps which layers slide, and one written before that was recorded is refused."""
    from magicpig_jax.io.checkpoint import MARKER, read_checkpoint_config
    from magicpig_jax.io.loader import convert_model
    from tests.test_io_families import _spm_vocab

    ref = _ref("mistral_window")
    path = write_gguf(_folder("mistral_window", tmp_path), tmp_path / "w.gguf", spm_vocab=_spm_vocab(),
                      metadata={"llama.attention.sliding_window": 8})
    model = load_model(path)
    assert model.config.windowed_layers == (0, 1)
    assert float(np.abs(forward_logits(model, ref["prompt_ids"].tolist()) - ref["logits"]).max()) <= TOLERANCE
    folder = _folder("qwen2_window", tmp_path)
    # a qwen2 GGUF cannot say which layers slide (transformers: max_window_layers): refused, naming the key,
    # unless the window is no shorter than the context (it never binds)
    from magicpig_jax.io.gguf_model import read_gguf_config
    from magicpig_jax.models.limits import UnsupportedConfigError

    for window, refused in ((8, True), (512, False)):
        qpath = write_gguf(folder, tmp_path / f"q{window}.gguf", pre="qwen2",
                           metadata={"qwen2.attention.sliding_window": window})
        if refused:
            with pytest.raises(UnsupportedConfigError, match=r"qwen2.attention.sliding_window = 8 \(shorter than "
                                                             r"the context, 512\): a qwen2 GGUF does not say"):
                read_gguf_config(qpath)
        else:
            assert read_gguf_config(qpath).sliding_window == 512
    out = convert_model(str(folder), tmp_path / "ckpt")
    config = read_checkpoint_config(out)
    assert config == load_model(folder).config and config.windowed_layers == (1,)
    qref = _ref("qwen2_window")
    logits = forward_logits(load_model(out), qref["prompt_ids"].tolist())
    assert float(np.abs(logits - qref["logits"]).max()) <= TOLERANCE
    meta = json.loads((out / MARKER).read_text())
    meta["format_version"] = 2
    del meta["config"]["sliding_layers"]
    (out / MARKER).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="does not record which layers it applies to: convert the model again"):
        read_checkpoint_config(out)


def test_eval_bench_and_cost_see_whether_a_window_binds(tmp_path):
    """The eval checks and decodes with the run's positions: a window longer than the run (the
    fixture's 4,096 against its context of 512) never binds, so MagicPIG runs on every layer there,
    as generate() does; a binding one is refused before any work. The bytes a windowed layer reads
    are at most its window. bench decode refuses before timing anything."""
    from magicpig_jax.eval.bench_decode import main as bench_main
    from magicpig_jax.eval.cost import step_bytes
    from magicpig_jax.eval.methods import parse_methods
    from magicpig_jax.eval.run import _check_before_writing, _method_spec
    from magicpig_jax.eval.settings import EvalSettings

    settings = EvalSettings(tasks=[], lengths=[200], samples=1, methods=parse_methods("dense,magicpig:2x4"),
                            likelihood_tokens=16)
    full = load_model(FIXTURES / "mistral")  # sliding_window 4096, context 512
    _check_before_writing(full, settings, None)
    assert _method_spec(full, settings, (), settings.methods[1], None, 256).dense_layers == ()
    short = load_model(_folder("mistral_window", tmp_path))
    with pytest.raises(ValueError, match="every layer of this model attends through a sliding window of 8"):
        _check_before_writing(short, settings, None)
    shape = dict(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, context=1000.0, dense_layers=(),
                 fraction_per_layer={}, num_sink=4, num_local=64, kv_bytes=2)
    assert step_bytes("dense", **shape, layer_windows={1: 8})["k"] == (1000 + 8) * 2 * 16 * 2
    assert step_bytes("dense", **shape)["k"] == 2000 * 2 * 16 * 2
    out = tmp_path / "bench"
    with pytest.raises(ValueError, match="every layer of this model attends through a sliding window of 8"):
        bench_main(["--model", str(_folder("mistral_window", tmp_path / "b")), "--lengths", "100", "--methods",
                    "dense", "magicpig", "--steps", "3", "--repeats", "3", "--warmup", "0", "--out", str(out)])
    assert not list(tmp_path.glob("bench*"))  # nothing timed, nothing written


def test_windows_past_int32_positions_are_refused(tmp_path):
    from magicpig_jax.models.config import LlamaConfig
    from tests.test_io_families import _spm_vocab

    base = json.loads((FIXTURES / "mistral" / "config.json").read_text())
    with pytest.raises(ValueError, match="'sliding_window' must be a positive integer"):
        LlamaConfig.from_hf_config({**base, "sliding_window": 2**31})
    assert LlamaConfig.from_hf_config({**base, "sliding_window": 2**31 - 1}).sliding_window == 2**31 - 1
    with pytest.raises(ValueError, match=r"llama.attention.sliding_window = 4294967295 must be in \[0, 2147483647\]"):
        load_model(write_gguf(FIXTURES / "mistral", tmp_path / "w.gguf", spm_vocab=_spm_vocab(),
                              metadata={"llama.attention.sliding_window": 2**32 - 1}))
