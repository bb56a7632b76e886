"""Gemma 2 models (``model_type`` gemma2, GGUF ``gemma2``) against transformers' logits
(``fixtures/families/gemma2*``, written by ``fixtures/make_families.py gemma2``) and its config rules;
attention logit soft-capping in every decode path against the pure-JAX reference.

What sets Gemma 2 apart from Gemma 3 here: attention logit soft-capping (each scaled ``q . k`` becomes
``c tanh(s / c)``) and final logit soft-capping, no q/k norms, one RoPE base, and every other layer
sliding from the first. The fixture's caps (2 and 15) bind on its random weights (Gemma 2 ships 50
and 30): a decoder without them is far off. Its decoding through the window (host op and pure JAX,
against transformers) is in ``test_gemma_decode.py``, its offload-decoder run in ``test_offload.py``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magicpig_jax.attention import MagicPIGConfig, build_lsh_index, dense_attention, magicpig_attention
from magicpig_jax.generation import decode_spec, forward_logits, prefill
from magicpig_jax.io.loader import load_model, read_model_config
from magicpig_jax.models.backends import DecodeSpec, layer_projections
from magicpig_jax.models.config import LlamaConfig, UnsupportedConfigError
from tests.test_io_families import FIXTURES, TOLERANCE

FOLDER = FIXTURES / "gemma2"

# google/gemma-2-2b-it's config.json as published (transformers 4.42 format)
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid", "eos_token_id": [1, 107],
    "final_logit_softcapping": 30.0, "head_dim": 256, "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304, "initializer_range": 0.02,
    "intermediate_size": 9216, "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 8,
    "num_hidden_layers": 26, "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096, "torch_dtype": "float32",
    "transformers_version": "4.42.4", "use_cache": True, "vocab_size": 256000,
}


def _ref(name: str = "gemma2") -> dict:
    return dict(np.load(FIXTURES / f"{name}_logits.npz"))


def _with_config(tmp_path, name: str = "gemma2", **changes):
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder, dirs_exist_ok=True)
    cfg = json.loads((FIXTURES / name / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_config_follows_transformers():
    cfg = LlamaConfig.from_hf_config(GEMMA2_2B)
    # every other layer slides over 4096 positions, the first one included
    assert cfg.windowed_layers == tuple(range(0, 26, 2)) and cfg.sliding_window == 4096
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (50.0, 30.0)
    assert cfg.query_scale == 256 ** -0.5 and cfg.embedding_scale == math.sqrt(2304)
    assert not cfg.qk_norm and cfg.sandwich_norms and cfg.hidden_act == "gelu_tanh" and cfg.tie_word_embeddings
    assert cfg.local_rope_theta is None and cfg.rope_theta == 10000.0 and cfg.eos_token_ids == (1, 107)
    # Gemma2Config's defaults: caps 50 and 30, eos 1; a null cap is none
    bare = {k: v for k, v in GEMMA2_2B.items() if k not in ("attn_logit_softcapping", "final_logit_softcapping",
                                                             "eos_token_id")}
    cfg = LlamaConfig.from_hf_config(bare)
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap, cfg.eos_token_ids) == (50.0, 30.0, (1,))
    # Gemma-2-9B's and -27B's config.json repeat the window as sliding_window_size
    assert LlamaConfig.from_hf_config({**GEMMA2_2B, "sliding_window_size": 4096}).sliding_window == 4096
    cfg = LlamaConfig.from_hf_config({**GEMMA2_2B, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (cfg.attn_logit_softcap, cfg.final_logit_softcap) == (None, None)
    # Gemma-2-27B: query_pre_attn_scalar = hidden / heads = 144
    assert LlamaConfig.from_hf_config({**GEMMA2_2B, "query_pre_attn_scalar": 144}).query_scale == 144 ** -0.5


@pytest.mark.parametrize("changes, match", [
    ({"use_bidirectional_attention": True}, "'use_bidirectional_attention' = true is not supported"),
    ({"hidden_activation": "gelu"}, "'hidden_activation' = 'gelu' is not supported on a gemma2 model"),
    ({"hidden_act": "silu"}, "'hidden_act' = 'silu' is not supported on a gemma2 model"),
    ({"attn_logit_softcapping": 0}, "'attn_logit_softcapping' must be a finite number > 0 or null"),
    ({"final_logit_softcapping": -30.0}, "'final_logit_softcapping' must be a finite number > 0 or null"),
    # c, s / c and c tanh(s / c) must stay normal float32 numbers (the host ops' attribute is float32)
    ({"attn_logit_softcapping": 1e-40}, "'attn_logit_softcapping' must be None or a number in \\[0.001, 1e\\+06\\]"),
    ({"final_logit_softcapping": 3e38}, "'final_logit_softcapping' must be None or a number in \\[0.001, 1e\\+06\\]"),
    ({"sliding_window_size": 2048}, "'sliding_window_size' = 2048 differs from 'sliding_window' = 4096"),
    ({"query_pre_attn_scalar": None}, "'query_pre_attn_scalar' must be a finite number > 0, got None"),
    ({"rope_local_base_freq": 10000}, "field\\(s\\) 'rope_local_base_freq' of this gemma2 model are not implemented"),
    ({"sliding_window": None}, "'sliding_window' is null while 'layer_types' has 'sliding_attention' layers"),
])
def test_what_is_not_implemented_is_refused(changes, match):
    with pytest.raises(ValueError, match=match) as info:
        LlamaConfig.from_hf_config({**GEMMA2_2B, **changes})
    assert isinstance(info.value, UnsupportedConfigError) == ("must" not in match)


def test_logits_match_transformers(tmp_path):
    ref = _ref()
    model = load_model(FOLDER)
    assert model.config.windowed_layers == (0, 2) and model.config.query_scale == 24 ** -0.5
    assert (model.config.attn_logit_softcap, model.config.final_logit_softcap) == (2.0, 15.0)
    assert float(np.abs(forward_logits(model, ref["prompt_ids"].tolist()) - ref["logits"]).max()) <= TOLERANCE
    # each cap changes the logits: the fixture exercises both (a model without one is far off)
    for changes in ({"attn_logit_softcapping": None}, {"final_logit_softcapping": None}):
        other = load_model(_with_config(tmp_path, **changes))
        assert float(np.abs(forward_logits(other, ref["prompt_ids"].tolist()) - ref["logits"]).max()) > 0.1, changes


def test_every_backend_takes_the_models_soft_cap():
    """Each backend's spec carries the model's cap (test_gemma_decode.py decodes with each); a cap out
    of range is refused."""
    model = load_model(FOLDER)
    for attention, budget in (("dense", None), ("magicpig", None), ("magicpig-ref", None), ("topk", 0.1),
                              ("quest", 0.1), ("oracle", 0.1)):
        assert decode_spec(model, attention, budget=budget).logit_softcap == 2.0, attention
    assert DecodeSpec(backend="topk", budget=0.1, host=True, logit_softcap=2.0).logit_softcap == 2.0
    with pytest.raises(ValueError, match="softcap must be None or a number in"):
        DecodeSpec(backend="magicpig", logit_softcap=-1.0)


def test_oracle_sampling_soft_caps_its_weights():
    """Oracle sampling draws from softmax(c tanh(s / c)): its LSE is the capped one (float64 NumPy), and
    the mean of many draws is the capped attention's output, not the uncapped one's."""
    from magicpig_jax.attention import oracle_sampling_attention
    from tests import _np_reference as np_ref

    rng = np.random.default_rng(5)
    B, Hq, Hkv, N, D, cap = 2, 4, 2, 64, 8, 0.5
    q = rng.normal(size=(B, Hq, D)).astype(np.float32) * 4
    k, v = (rng.normal(size=(B, Hkv, N, D)).astype(np.float32) for _ in range(2))
    keep = np.ones((B, Hq, N), bool)
    want, want_lse = np_ref.selected(q, k, v, keep, cap)
    uncapped, _ = np_ref.selected(q, k, v, keep)
    out, lse, _ = oracle_sampling_attention(jax.random.key(0), jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                            50_000, softcap=cap)
    np.testing.assert_allclose(np.asarray(lse), want_lse, atol=2e-5, rtol=1e-5)
    err = float(np.abs(np.asarray(out) - want).max())
    assert err < 0.03 < float(np.abs(uncapped - want).max()), err


# --- soft-capping in the attention functions and the host ops ------------------------------------


@settings(deadline=None, max_examples=12)
@given(seed=st.integers(0, 2**31 - 1), cap=st.sampled_from([None, 0.3, 2.0, 50.0]), bf16=st.booleans(),
       n=st.integers(1, 300))
def test_host_ops_soft_cap_as_the_reference_does(seed, cap, bf16, n):
    """The host exact op and the MagicPIG host op equal dense_attention and magicpig_attention with the
    same cap (float64 NumPy for dense), float32 and bfloat16 caches, rows of different lengths."""
    from magicpig_jax import host

    rng = np.random.default_rng(seed)
    B, Hq, Hkv, N, D = 2, 4, 2, 320, 16
    q = rng.normal(size=(B, Hq, D)).astype(np.float32) * 3
    k = rng.normal(size=(B, Hkv, N, D)).astype(np.float32) * 2
    v = rng.normal(size=(B, Hkv, N, D)).astype(np.float32)
    lengths = np.array([n, max(1, n // 2)], np.int32)
    kv = (jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)) if bf16 else (jnp.asarray(k), jnp.asarray(v))
    kf, vf = (np.asarray(x, np.float64) for x in kv)
    # float64 NumPy: softmax of c tanh(q.k / sqrt(D) / c)
    s = np.einsum("bhgd,bhnd->bhgn", q.astype(np.float64).reshape(B, Hkv, Hq // Hkv, D), kf) / math.sqrt(D)
    s = s if cap is None else cap * np.tanh(s / cap)
    s = np.where(np.arange(N)[None, None, None, :] < lengths[:, None, None, None], s, -np.inf)
    w = np.exp(s - s.max(-1, keepdims=True))
    want = (np.einsum("bhgn,bhnd->bhgd", w, vf) / w.sum(-1)[..., None]).reshape(B, Hq, D)
    for out, _ in (dense_attention(jnp.asarray(q), *kv, jnp.asarray(lengths), softcap=cap),
                   host.host_exact_attention(jnp.asarray(q), *kv, jnp.asarray(lengths), softcap=cap),
                   host.host_exact_attention(jnp.asarray(q), *kv, jnp.asarray(lengths), softcap=cap, impl="scalar")):
        np.testing.assert_allclose(np.asarray(out), want, atol=2e-5, rtol=1e-4)
    cfg = MagicPIGConfig(K=4, L=12, num_sink=2, num_local=8)
    proj = layer_projections(cfg, 0, D)
    built = jnp.asarray(lengths)
    o_ref, l_ref, n_ref = magicpig_attention(jnp.asarray(q), *kv, build_lsh_index(kv[0], proj, cfg, built), cfg,
                                             built, softcap=cap)
    hidx = host.host_build_index(kv[0], proj, cfg, built, capacity=N)
    for window in (None, 0):
        o, lse, num = host.host_magicpig_attention(jnp.asarray(q), *kv, hidx, cfg, built, softcap=cap,
                                                   static_window=window)
        np.testing.assert_array_equal(np.asarray(num), np.asarray(n_ref))
        np.testing.assert_allclose(np.asarray(o), np.asarray(o_ref), atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(lse), np.asarray(l_ref), atol=2e-5, rtol=1e-5)


def test_soft_capping_keeps_non_finite_logits_visible():
    """A NaN or infinite key still gives NaN (not a capped, finite logit), in the host op as in JAX."""
    from magicpig_jax import host

    q = jnp.ones((1, 2, 8), jnp.float32)
    k = jnp.ones((1, 1, 16, 8), jnp.float32).at[0, 0, 3].set(jnp.inf)
    v = jnp.ones((1, 1, 16, 8), jnp.float32)
    for out, lse in (dense_attention(q, k, v, softcap=5.0), host.host_exact_attention(q, k, v, softcap=5.0)):
        assert bool(jnp.isnan(lse).all()) and bool(jnp.isnan(out).all())


@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan"), float("inf"), 1e-40, 1e39, True, "50"])
def test_bad_softcap_is_refused(bad):
    import functools

    from magicpig_jax import host
    from magicpig_jax.attention import oracle_sampling_attention, quest_attention, topk_attention

    q, k = jnp.ones((1, 2, 8)), jnp.ones((1, 1, 4, 8))
    pages = host.quest_build_pages(k, jnp.zeros((1,), jnp.int32), jnp.full((1,), 4, jnp.int32), 2)
    for fn in (dense_attention, host.host_exact_attention, functools.partial(topk_attention, budget=2),
               functools.partial(host.host_topk_attention, budget=2), functools.partial(quest_attention, page_size=2,
                                                                                       budget=2),
               lambda q, k, v, softcap: host.host_quest_attention(q, k, v, pages, 2, softcap=softcap),
               functools.partial(oracle_sampling_attention, jax.random.key(0), budget=2)):
        # a non-number is a TypeError under the suite's runtime type checks, else this ValueError
        with pytest.raises((ValueError, TypeError), match="softcap"):
            fn(q, k, k, softcap=bad)


@pytest.mark.parametrize("op", ["magicpig_exact_attention", "magicpig_topk_attention"])
@pytest.mark.parametrize("attr", [1e-40, -1e-40, 1.2e-38, 5e-4, float("nan")])
def test_the_ops_refuse_a_softcap_attribute_out_of_range(op, attr):
    """The ops' own check (the wrappers refuse first): a subnormal cap, which XLA's threads flush to
    zero, is not taken for 0 (none), so the op never runs uncapped when a cap was asked for."""
    from magicpig_jax.host._ext import ops

    ops()
    q, k = jnp.ones((1, 2, 8)), jnp.ones((1, 1, 4, 8))
    n = jnp.full((1,), 4, jnp.int32)
    types = (jax.ShapeDtypeStruct((1, 2, 8), jnp.float32), jax.ShapeDtypeStruct((1, 2), jnp.float32))
    ints = dict(impl=np.int64(0), max_threads=np.int64(0))
    zero = jnp.zeros((1,), jnp.int32)
    args = ((q, k, k, n, zero) if op.endswith("exact_attention")  # lengths, starts
            else (q, k, k, zero, n, jnp.full((1,), 2, jnp.int32), n))  # start, end, keep, context
    extra = {} if op.endswith("exact_attention") else {"with_static": np.int64(0)}
    call = jax.ffi.ffi_call(op, types)
    jax.block_until_ready(call(*args, **ints, **extra, softcap=np.float32(0.0)))  # the call is well formed
    with pytest.raises(Exception, match="softcap must be 0 \\(none\\) or in"):
        jax.block_until_ready(call(*args, **ints, **extra, softcap=np.float32(attr)))


# --- GGUF (llama.cpp's gemma2) ----------------------------------------------------------------


def _gguf(folder, out, **kw):
    from tests.fixtures.gguf_convert import write_gguf
    from tests.test_io_families import _spm_vocab

    return write_gguf(folder, out, spm_vocab=_spm_vocab(), **kw)


def test_gguf_matches_transformers(tmp_path):
    """The fixture with the query scale 1/sqrt(head_dim) (what llama.cpp's gemma2 holds below 46
    layers) as a GGUF written under llama.cpp's converter conventions: the HF directory's config and
    transformers' logits; without the soft-capping keys llama.cpp's defaults (50, 30) and window (4096)."""
    from magicpig_jax.io.gguf_model import GGUFMetadataError

    ref = _ref("gemma2_default")
    hf = load_model(FIXTURES / "gemma2_default")
    gguf_model = load_model(_gguf(FIXTURES / "gemma2_default", tmp_path / "g.gguf"))
    for key in ("windowed_layers", "sliding_window", "local_rope_theta", "rope_theta", "rope_scaling", "query_scale",
                "embedding_scale", "hidden_act", "sandwich_norms", "qk_norm", "tie_word_embeddings",
                "attn_logit_softcap", "final_logit_softcap"):
        assert getattr(gguf_model.config, key) == getattr(hf.config, key), key
    for model in (hf, gguf_model):
        assert float(np.abs(forward_logits(model, ref["prompt_ids"].tolist()) - ref["logits"]).max()) <= TOLERANCE
    bare = read_model_config(_gguf(FIXTURES / "gemma2_default", tmp_path / "bare.gguf", metadata={
        "gemma2.attn_logit_softcapping": None, "gemma2.final_logit_softcapping": None,
        "gemma2.attention.sliding_window": None}))
    assert (bare.attn_logit_softcap, bare.final_logit_softcap, bare.sliding_window) == (50.0, 30.0, 4096)
    with pytest.raises(GGUFMetadataError, match="gemma2.attn_logit_softcapping = 0.0 must be a number in"):
        read_model_config(_gguf(FIXTURES / "gemma2_default", tmp_path / "z.gguf",
                                metadata={"gemma2.attn_logit_softcapping": 0.0}))
    with pytest.raises(GGUFMetadataError, match="a gemma2 model needs gemma2.attention.sliding_window > 0"):
        read_model_config(_gguf(FIXTURES / "gemma2_default", tmp_path / "w0.gguf",
                                metadata={"gemma2.attention.sliding_window": 0}))
    # gemma3's key is not gemma2's
    with pytest.raises(UnsupportedConfigError, match="gemma2.rope.freq_base_swa"):
        read_model_config(_gguf(FIXTURES / "gemma2_default", tmp_path / "swa.gguf",
                                metadata={"gemma2.rope.freq_base_swa": 10000.0}))


# --- the study's queries ------------------------------------------------------------------------


def test_decode_queries_see_only_the_window():
    """``decode_queries`` (the queries of calibrate and of the study's capture) attends through each
    layer's window, as the decoder does: keys before every window may hold anything without changing
    a query. Before, it attended to every key, and the queries past layer 0 were another model's."""
    import jax
    from flax import nnx

    from magicpig_jax.models.cache import KVCache
    from magicpig_jax.models.decoding import decode_queries
    from tests._tiny import TINY, tiny_model

    model = tiny_model(0, dataclasses.replace(TINY, sliding_window=16, sliding_layers=None))
    state = prefill(model, [list(range(3, 93))], 1)
    graphdef, params = nnx.split(model.module)
    token = jnp.asarray([5], jnp.int32)
    q = decode_queries(graphdef, params, state.cache, token)
    # the next query (position 90) sees 75 .. 90: overwrite 0 .. 74 of every layer
    noise = [x.at[:, :, :75].set(jax.random.normal(jax.random.key(i), x[:, :, :75].shape, x.dtype))
             for i, x in enumerate(state.cache.k)]
    q_noise = decode_queries(graphdef, params, KVCache(k=tuple(noise), v=state.cache.v, lengths=state.cache.lengths),
                             token)
    np.testing.assert_allclose(np.asarray(q_noise), np.asarray(q), atol=1e-6)
    unwindowed = tiny_model(0)  # the same weights without the window: other queries past layer 0
    q_full = decode_queries(*nnx.split(unwindowed.module), state.cache, token)
    assert float(jnp.abs(q_full[1:] - q[1:]).max()) > 1e-3


def test_a_capture_carries_the_cap_into_the_study(tmp_path):
    """Gemma 2's capture records its cap (0 for Gemma 3's none); the study's dense reference and
    estimators use it: TopK's relative errors are float64 NumPy's with the cap (and without it when
    none is given); a malformed cap in a capture is refused."""
    from magicpig_jax.eval import study
    from magicpig_jax.eval.capture import capture_qkv
    from magicpig_jax.eval.study_measure import StudySettings, run_case
    from tests import _np_reference as np_ref

    text = "This program is free software: you can redistribute it and/or modify it."
    data = capture_qkv(load_model(FOLDER), text, max_tokens=8)  # within the window of 8
    assert data["attn_logit_softcap"] == np.float32(2.0)
    layer = [data[x][1:2] for x in ("q", "k", "v")]
    settings = StudySettings(fractions=(1.0, 0.5), lsh=((3, 6),), num_sink=1, num_local=1, repeats=1, heavy=())
    Hq = layer[0].shape[1]
    half = np_ref.topk_keep(layer[0], layer[1], [4], [8])
    errors = {}
    for softcap in (2.0, None):
        dense = np_ref.selected(*layer, np.ones((1, Hq, 8), bool), softcap)[0][0]
        topk = np_ref.selected(*layer, half, softcap)[0][0]
        want = float(np.mean(np.linalg.norm(topk - dense, axis=-1) / np.linalg.norm(dense, axis=-1)))
        rec = {(r["method"], r["params"].get("budget")): r for r in run_case(*layer, settings, softcap=softcap)}
        assert rec[("topk", 1.0)]["rel_error"] <= 1e-5 and rec[("quest", 1.0)]["rel_error"] <= 1e-5
        assert rec[("topk", 0.5)]["rel_error"] == pytest.approx(want, rel=1e-4, abs=1e-6), softcap
        errors[softcap] = want
    assert abs(errors[2.0] - errors[None]) > 0.01 * errors[None]  # the cap binds on this layer
    np.savez(tmp_path / "c.npz", **data)
    assert [case[-1] for case in study._load_capture(tmp_path / "c.npz", "0,3")] == [2.0, 2.0]
    for bad in (np.float32(-1.0), np.float32(np.nan), np.array([2.0], np.float32), np.int32(2)):
        np.savez(tmp_path / "bad.npz", **(data | {"attn_logit_softcap": bad}))
        with pytest.raises(ValueError, match="attn_logit_softcap"):
            study._load_capture(tmp_path / "bad.npz", None)
    gemma3 = load_model(FIXTURES / "gemma3")
    text = "This program is free software: you can redistribute it and/or modify it."
    with pytest.raises(ValueError, match="layers \\[0, 2\\] attend through a sliding window of 8 tokens"):
        capture_qkv(gemma3, text)
    captured = capture_qkv(gemma3, text, max_tokens=8)
    assert captured["k"].shape[2] == 8 and captured["attn_logit_softcap"] == 0.0
