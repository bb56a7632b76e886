"""The public API refuses what it would otherwise read wrongly (an independent break-it audit's
findings): token ids outside the vocabulary, lengths past int32, non-integer layer indices,
integer hyperplanes, options a backend does not read, a hand-made index of the wrong shapes."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magicpig_jax import lsh
from magicpig_jax.attention import (
    LayerConfigs,
    MagicPIGConfig,
    budget_tokens,
    build_lsh_index,
    magicpig_attention,
    merge_attention,
    static_attention,
)
from magicpig_jax.generation import decode, decode_spec, forward_logits, generate, prefill
from tests._tiny import TINY, tiny_model


def _exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _qkv(B=2, Hq=4, Hkv=2, N=16, D=8, seed=0):
    r = np.random.default_rng(seed)
    return tuple(jnp.asarray(r.standard_normal(s), jnp.float32) for s in ((B, Hq, D), (B, Hkv, N, D), (B, Hkv, N, D)))


def test_token_ids_outside_the_vocabulary_are_refused(model):
    V = TINY.vocab_size
    for bad in (V, 10**6, -1):  # V and above read past the embedding (NaN); -1 wrapped to the last id
        with pytest.raises(ValueError, match=_exact(f"ids holds token id {bad}, outside the model's vocabulary "
                                                    f"[0, {V})")):
            forward_logits(model, [1, 2, bad])
        with pytest.raises(ValueError, match=re.escape(f"prompts[1] holds token id {bad}, outside")):
            prefill(model, [[1, 2], [3, bad]], 2)
    with pytest.raises(TypeError, match=_exact("ids must hold integer token ids, got dtype float64")):
        forward_logits(model, [1.7, 2.2])
    assert np.isfinite(forward_logits(model, [0, V - 1])).all()  # both ends of the range are tokens


def test_lengths_past_int32_clip_instead_of_wrapping():
    from magicpig_jax.attention import dense_attention
    from magicpig_jax.attention._common import check_lengths

    # NumPy lengths (what a caller without the suite's annotation checks may pass): int64 past
    # int32 wrapped to 3, uint32 2**32 - 1 to -1 (no key)
    for lengths in (np.array([2**33 + 3, -5], np.int64), np.array([2**32 - 1, 0], np.uint32)):
        np.testing.assert_array_equal(np.asarray(check_lengths(lengths, 2, 16)), [16, 0])
    np.testing.assert_array_equal(np.asarray(check_lengths(jnp.array([2**32 - 1, 0], jnp.uint32), 2, 16)), [16, 0])
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda n: check_lengths(n, 2, 16))(
        jnp.array([2**32 - 1, 3], jnp.uint32))), [16, 3])
    # a narrow JAX integer array: N = 300 clipped in int8 wrapped to 44, so every function read 44 keys of 100
    # (a fresh reviewer's finding: dense, TopK, MagicPIG and the host index all agreed on the wrong count)
    for dtype in (jnp.int8, jnp.uint8, jnp.int16, jnp.uint16):
        lengths = jnp.array([100, 0], dtype)
        np.testing.assert_array_equal(np.asarray(check_lengths(lengths, 2, 300)), [100, 0])
        np.testing.assert_array_equal(np.asarray(jax.jit(lambda n: check_lengths(n, 2, 300))(lengths)), [100, 0])
    k = jnp.asarray(np.random.default_rng(0).normal(size=(1, 1, 300, 4)), jnp.float32)
    q = jnp.ones((1, 1, 4), jnp.float32)
    from magicpig_jax.attention.baselines import quest_pages_kept, quest_rows_read
    from tests._messages import without_jaxtyping

    with without_jaxtyping():  # (the suite's annotation check takes uint8 for no Int)
        for dtype, n, pages in ((jnp.int8, 120, 8), (jnp.uint8, 250, 16)):  # were -8 and 0 pages (120 + 15 wrapped)
            assert int(quest_pages_kept(1.0, jnp.array([n], dtype), 16)[0]) == pages
            assert int(quest_rows_read(1.0, jnp.array([n], dtype), 16)[0]) == n
    _, lse8 = dense_attention(q, k, k, jnp.array([100], jnp.int8))
    _, lse32 = dense_attention(q, k, k, jnp.array([100], jnp.int32))
    np.testing.assert_array_equal(np.asarray(lse8), np.asarray(lse32))


def test_layer_indices_must_be_integers_in_range(model):
    cfg = MagicPIGConfig(K=2, L=4, num_sink=1, num_local=2)
    for bad in ([99], [-1]):
        with pytest.raises(ValueError, match=_exact(f"dense_layers must be in [0, 4), got {tuple(bad)}")):
            LayerConfigs.uniform(cfg, 4, dense_layers=bad)
    for bad, shown in (([0.5], "0.5"), ([True], "True")):
        with pytest.raises(TypeError, match=_exact(f"dense_layers must hold integer layer indices, got {shown}")):
            decode_spec(model, "magicpig", cfg, bad)
    with pytest.raises(TypeError, match=_exact("dense_layers must be a sequence of layer indices, got '01'")):
        decode_spec(model, "magicpig", cfg, "01")
    assert decode_spec(model, "magicpig", cfg, [np.int64(1)]).dense_layers == (1,)
    with pytest.raises(TypeError, match="0.7"):  # ours, or jaxtyping's (the suite checks the annotations)
        LayerConfigs(((0.7, cfg),))


def test_integer_hyperplanes_are_refused():
    q, k, v = _qkv()
    cfg = MagicPIGConfig(K=2, L=4, num_sink=1, num_local=2)
    proj = lsh.simhash_projections(jax.random.key(0), 8, 2, 4)
    from magicpig_jax.attention.magicpig import check_index_fits

    with pytest.raises(TypeError, match="projections"):  # ours, or jaxtyping's (the suite checks the annotations)
        build_lsh_index(k, proj.astype(jnp.int32), cfg)
    index = build_lsh_index(k, proj, cfg)
    object.__setattr__(index, "projections", proj.astype(jnp.int32))  # as a hand-made index may hold
    with pytest.raises(TypeError, match=_exact("index.projections must be a float array, got int32")):
        check_index_fits(index, cfg, 2, 2, 16, 8)


def test_a_hand_made_index_of_the_wrong_shapes_is_refused():
    q, k, v = _qkv()
    cfg = MagicPIGConfig(K=2, L=4, num_sink=1, num_local=2)
    index = build_lsh_index(k, lsh.simhash_projections(jax.random.key(0), 8, 2, 4), cfg)
    for name, bad, want in (("mean", index.mean[:, :1], "[2, 2, 8]"), ("start", index.start[:1], "[2]"),
                            ("end", index.end[:, None], "[2]")):
        with pytest.raises((ValueError, TypeError), match=re.escape(f"index.{name} must be {want}, got "
                                                                    f"{list(bad.shape)}") + "|" + name):
            magicpig_attention(q, k, v, dataclasses.replace(index, **{name: bad}), cfg)


def test_page_size_outside_quest_is_refused(model):
    cfg = MagicPIGConfig(K=2, L=4, num_sink=1, num_local=2)
    state = prefill(model, [[1, 2, 3]], 2)
    with pytest.raises(ValueError, match=_exact("page_size applies to attention 'quest' only, got "
                                                "attention='magicpig'")):
        decode(model, state, attention="magicpig", config=cfg, page_size=8)
    with pytest.raises(ValueError, match=r"^attention must be one of"):  # the unknown name comes first
        decode(model, state, attention="nope", page_size=8)
    # one loop over the backends with the same config: dense takes it and reads none of it
    dense, _ = decode(model, state, attention="dense", config=cfg, max_new_tokens=2)
    assert dense == decode(model, state, attention="dense", max_new_tokens=2)[0]


def test_prompts_that_are_no_text_are_named(model):
    for content, kind in ((3, "int"), (None, "NoneType"), (["a"], "list")):
        with pytest.raises(TypeError, match=_exact(f"prompt message 0 content must be a str, got {kind}")):
            generate(model, [{"role": "user", "content": content}])
    with pytest.raises(ValueError, match=_exact("the prompt encodes to no token (an empty text with chat=False)")):
        generate(model, "", chat=False)


def test_a_batch_names_the_row_it_refuses(model):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from magicpig_jax.io.tokenizer import Tokenizer

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    chat = dataclasses.replace(model, tokenizer=Tokenizer(HFTokenizer(models.BPE()), chat_template=template,
                                                          eos_token_ids=()))
    with pytest.raises(TypeError, match=_exact("prompt 2: prompt message 0 content must be a str, got int")):
        generate(chat, ["hi", "yo", [{"role": "user", "content": 5}]])
    with pytest.raises(ValueError, match=_exact("prompt 1: prompt must hold at least one message")):
        generate(chat, ["hi", []])
    ctx = model.config.max_position_embeddings
    with pytest.raises(ValueError, match=_exact(f"prompt 1 has {ctx + 1} tokens, longer than the model's context "
                                                f"of {ctx} tokens")):
        prefill(model, [[1, 2], [1] * (ctx + 1)], 2)


def test_static_and_budget_arguments_are_typed():
    # in the suite jaxtyping checks the annotations first; either message names the argument
    q, k, v = _qkv()
    n = jnp.array([16, 16])
    zero = jnp.zeros(2, jnp.int32)
    for kw, name in (({"num_sink": None}, "num_sink"), ({"num_sink": 2.5}, "num_sink"),
                     ({"num_sink": 1, "window": 3.5}, "window")):
        with pytest.raises(TypeError, match=f"{name} must be a static int, got|parameter '{name}'"):
            static_attention(q, k, v, zero, n, n, **kw)
    with pytest.raises(TypeError, match="lengths must be an integer array, got float32|parameter 'lengths'"):
        budget_tokens(0.5, jnp.array([4.0, 5.0]))
    np.testing.assert_array_equal(np.asarray(budget_tokens(0.5, jnp.array([-4, 5]))), [0, 3])


def test_merge_refuses_a_positive_infinite_lse():
    out = jnp.ones((1, 1, 2), jnp.float32)
    for lse_a in (jnp.inf, jnp.nan):
        o, lse = merge_attention(out, jnp.full((1, 1), lse_a), out, jnp.zeros((1, 1)))
        assert np.isnan(np.asarray(o)).all() and np.isnan(np.asarray(lse)).all()


def test_the_shape_check_refuses_what_it_cannot_read():
    """A head dimension of 0 gave lse NaN (0 / sqrt(0)) without a word; a static softcap runs under jit."""
    from magicpig_jax.attention import dense_attention, topk_attention

    k = jnp.zeros((1, 1, 4, 0))
    for fn in (dense_attention, lambda q, k, v: topk_attention(q, k, v, 2)):
        with pytest.raises(ValueError, match=_exact("the head dimension D must be >= 1, got q (1, 1, 0)")):
            fn(jnp.zeros((1, 1, 0)), k, k)
    k = jnp.zeros((1, 1, 4, 2))
    out, _ = jax.jit(dense_attention, static_argnames="softcap")(jnp.ones((1, 1, 2)), k + 1, k + 2, softcap=30.0)
    np.testing.assert_allclose(np.asarray(out), 2.0)


_WITHOUT_TYPE_CHECKER = """
import jax, jax.numpy as jnp, numpy as np
from magicpig_jax.attention import cost_model, dense_attention
k = jnp.zeros((1, 1, 4, 2))
for call in (lambda: dense_attention([[[0.0, 0.0]]], k, k),
             lambda: jax.jit(lambda c: dense_attention(jnp.zeros((1, 1, 2)), k, k, softcap=c))(30.0),
             lambda: cost_model.tables_for_fraction(np.zeros(3), 10, 0.05, max_L=2.5)):
    try:
        call()
    except (TypeError, ValueError) as err:
        print(type(err).__name__, str(err))
"""


def test_our_own_checks_name_what_the_suite_type_checker_catches_first():
    """The suite runs with jaxtyping's runtime type checker (tests/conftest.py), which catches these
    first; a user's process has none: our checks name the parameter (a Python list for q had been an
    AttributeError, a traced softcap was refused as if its value were wrong)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _WITHOUT_TYPE_CHECKER], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "TypeError q must be an array (jax.Array or numpy.ndarray), got list",
        "ValueError softcap must be a static number (None or in [0.001, 1e+06]), got a traced value: under "
        "jax.jit pass it as a static argument (static_argnames=('softcap',))",
        "ValueError max_L must be an int in [2, 65536] (lsh.MAX_L), got max_L=2.5",
    ]


def test_tables_for_fraction_takes_numpy_scalars_and_stops_at_max_l():
    from magicpig_jax.attention import cost_model

    cos = np.linspace(-0.2, 0.6, 101)
    assert cost_model.tables_for_fraction(cos, 10, np.float32(0.05)) == cost_model.tables_for_fraction(cos, 10, 0.05)
    # p = 0.5 for every key at K = 20: reaching half the keys needs more than lsh.MAX_L tables
    with pytest.raises(ValueError, match=_exact(f"target fraction 0.5 is not reached with K=20 and L <= {lsh.MAX_L}")):
        cost_model.tables_for_fraction(np.zeros(4), 20, 0.5)
    for bad in (1, lsh.MAX_L + 1, True):
        with pytest.raises(ValueError, match=r"^max_L must be an int in \[2, 65536\]"):
            cost_model.tables_for_fraction(cos, 10, 0.05, max_L=bad)
    with pytest.raises((ValueError, TypeError), match="max_L"):  # the suite's type checker comes first
        cost_model.tables_for_fraction(cos, 10, 0.05, max_L=2.5)


def test_a_max_new_tokens_past_int32_decodes_to_the_context():
    """A row stops where the context is full, so any max_new_tokens is valid; one past int32 had
    raised OverflowError after the prefill (the per-row limit was computed in int32)."""
    small = tiny_model(config=dataclasses.replace(TINY, max_position_embeddings=40))
    state = prefill(small, [[1, 2, 3]], 10**12)
    ids, stats = decode(small, state, attention="dense", max_new_tokens=10**12, stop_on_eos=False)
    ref, _ = decode(small, state, attention="dense", max_new_tokens=38, stop_on_eos=False)
    assert ids == ref and len(ids[0]) == 38  # token i sits at position 3 + i - 1 <= 40


def test_tables_for_fraction_never_returns_more_than_max_l():
    """With max_L = 2 or 3 the search started at L = 4 and could return it."""
    from magicpig_jax.attention import cost_model, expected_sampled_fraction

    cos = np.linspace(-0.2, 0.9, 41)
    target = float(expected_sampled_fraction(cos, 3, 4)) * 0.999  # reached at L = 4, not at 3
    assert float(expected_sampled_fraction(cos, 3, 3)) < target
    assert cost_model.tables_for_fraction(cos, 3, target) == 4
    for max_L in (2, 3):
        with pytest.raises(ValueError, match=f"is not reached with K=3 and L <= {max_L}"):
            cost_model.tables_for_fraction(cos, 3, target, max_L=max_L)
    assert cost_model.tables_for_fraction(cos, 3, target, max_L=4) == 4


def test_prefill_and_forward_refuse_what_they_would_read_wrongly():
    """From a Raises audit: an int32 cache_dtype stored K and V rounded (logits off by 1.75, no error),
    float16 failed only in decode, 'bf16' raised NumPy's error; a 2-D array or a flat list of ids
    raised len()/truth-value errors; a float prefix length was cut; forward_logits returned NaN logits
    of a broken model without a word (decode raises FloatingPointError)."""
    from magicpig_jax.generation import prefill_with_prefixes

    model = tiny_model(0)
    for dtype in (jnp.int32, jnp.float16, "bf16", np.uint8):
        with pytest.raises(ValueError, match="cache_dtype must be float32 or bfloat16"):
            prefill(model, [[1, 2, 3]], 4, cache_dtype=dtype)
    assert prefill(model, [[1, 2, 3]], 4, cache_dtype="bfloat16").cache.k[0].dtype == jnp.bfloat16
    for prompts in (np.array([[1, 2, 3]]), [1, 2, 3], "abc"):
        with pytest.raises(TypeError, match="prompts must be a list of token-id lists"):
            prefill(model, prompts, 4)
    np.testing.assert_array_equal(np.asarray(prefill(model, [np.array([1, 2, 3])], 4).last_logits),
                                  np.asarray(prefill(model, [[1, 2, 3]], 4).last_logits))
    for lengths in ([1.7], None, ["x"], [True]):
        with pytest.raises(TypeError, match="prefix_lengths must be a list of ints"):
            prefill_with_prefixes(model, [[1, 2, 3]], lengths, 4)
    with pytest.raises(TypeError, match="ids must be a flat sequence"):
        forward_logits(model, [[1, 2]])
    broken = tiny_model(0)
    w = broken.module.layers[1].self_attn.q_proj.kernel
    w[...] = w[...].at[0, 0].set(jnp.nan)
    with pytest.raises(FloatingPointError, match=r"the logits at position 0 \(of 3\) contain NaN"):
        forward_logits(broken, [1, 2, 3])


def test_decode_names_a_state_progress_or_mesh_of_the_wrong_kind():
    from magicpig_jax.io.loader import load_model

    model = tiny_model(0)
    state = prefill(model, [[1, 2, 3]], 4)
    with pytest.raises(TypeError, match="state must be a PrefillState"):
        decode(model, None, attention="dense", max_new_tokens=2)
    with pytest.raises(TypeError, match="progress must be callable"):
        decode(model, state, attention="dense", max_new_tokens=2, progress="x")
    with pytest.raises(ValueError, match=r"mesh must be a jax.sharding.Mesh with axes \('batch', 'kv_heads'\), "
                                         "got 'x'"):
        decode(model, state, attention="dense", max_new_tokens=2, mesh="x")
    with pytest.raises(TypeError, match="path must be a str or os.PathLike"):
        load_model(123)


def test_simhash_refuses_vectors_of_no_coordinates_and_hyperplanes_that_are_not_arrays():
    """D = 0 raised JAX's 'zero-size array to reduction operation' or a ZeroDivisionError; a list of
    hyperplanes an AttributeError."""
    from magicpig_jax.host import host_simhash_codes

    x, proj = jnp.zeros((2, 3, 0)), jnp.zeros((0, 8))
    with pytest.raises(ValueError, match="D >= 1"):
        lsh.simhash_codes(x, proj, 4, 2)
    with pytest.raises(ValueError, match="D >= 1"):
        lsh.collision_probability(x, x)
    with pytest.raises(ValueError, match="D >= 1"):
        host_simhash_codes(x, proj, 4, 2)
    with pytest.raises(TypeError, match="projections and center must be arrays"):
        host_simhash_codes(jnp.ones((2, 4)), np.ones((4, 8)).tolist(), 4, 2)


def test_convert_refuses_an_occupied_out_before_reading_the_source(tmp_path, monkeypatch):
    """It read and hashed the whole source (4.4 s for the embedded model; minutes for a large one)
    before the FileExistsError."""
    from magicpig_jax.io import loader

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "file").write_text("x")

    def no_read(path):
        raise AssertionError("the source was read")

    monkeypatch.setattr(loader, "_read_source", no_read)
    with pytest.raises(FileExistsError, match="is not an empty directory"):
        loader.convert_model("embedded", tmp_path / "out")


def test_a_key_that_is_not_one_prng_key_is_named():
    """rng=0, None, a float array or a batch of keys raised JAX's errors naming no argument, after the
    oracle's softmax had run."""
    from magicpig_jax.attention import oracle_sampling_attention
    from tests._messages import without_jaxtyping

    q, k = jnp.ones((1, 2, 4)), jnp.ones((1, 1, 8, 4))
    for bad in (0, None, jnp.ones(2), jax.random.split(jax.random.key(0), 3), jnp.zeros(3, jnp.uint32)):
        with without_jaxtyping(), pytest.raises(TypeError, match="rng must be one jax.random key"):
            oracle_sampling_attention(bad, q, k, k, 4)
        with without_jaxtyping(), pytest.raises(TypeError, match="key must be one jax.random key"):
            lsh.simhash_projections(bad, 4, 2, 2)
    for good in (jax.random.key(0), jax.random.PRNGKey(0)):
        assert oracle_sampling_attention(good, q, k, k, 4)[0].shape == (1, 2, 4)
        assert lsh.simhash_projections(good, 4, 2, 2).shape == (4, 4)


def test_lists_where_arrays_are_expected_are_named():
    """A list of hyperplanes, or an index field holding a list, raised AttributeError ('shape')."""
    from magicpig_jax import host
    from tests._messages import without_jaxtyping

    cfg = MagicPIGConfig(K=2, L=4, num_sink=1, num_local=2)
    k = jnp.ones((1, 1, 16, 4))
    proj = lsh.simhash_projections(jax.random.key(0), 4, 2, 4)
    with without_jaxtyping():
        with pytest.raises(TypeError, match="projections must be an array"):
            host.host_build_index(k, np.asarray(proj).tolist(), cfg)
        index = build_lsh_index(k, proj, cfg)
        bad = dataclasses.replace(index, codes=np.asarray(index.codes).tolist())
        with pytest.raises(TypeError, match="index.codes must be an array, got list"):
            magicpig_attention(jnp.ones((1, 2, 4)), k, k, bad, cfg)


def test_the_new_checks_take_every_valid_form():
    """A re-review: rows that are JAX arrays or ranges, JAX prefix lengths, raw rbg keys and a 0-d
    capacity were refused by the checks above; forced_decode of None or a consumed state raised
    AttributeError."""
    from magicpig_jax.eval.forcing import forced_decode
    from magicpig_jax.generation import prefill_with_prefixes
    from magicpig_jax.host.quest import quest_build_pages

    model = tiny_model(0)
    want = np.asarray(prefill(model, [[1, 2, 3]], 4).last_logits)
    for row in (jnp.asarray([1, 2, 3]), range(1, 4), (1, 2, 3), np.asarray([1, 2, 3], np.int64)):
        np.testing.assert_array_equal(np.asarray(prefill(model, [row], 4).last_logits), want)
    for lengths in (jnp.asarray([2]), [np.int32(2)], (2,), np.asarray([2])):
        assert list(prefill_with_prefixes(model, [[1, 2, 3]], lengths, 4)[1].prompt_lengths) == [2]
    for prompts, row in (([[1, 2], "ab"], 1), ([[[1, 2]]], 0)):
        with pytest.raises(TypeError, match=rf"prompts\[{row}\] is"):
            prefill(model, prompts, 4)
    from tests._messages import without_jaxtyping

    impl = jax.config.jax_default_prng_impl
    try:  # under rbg a raw key is uint32[4]
        jax.config.update("jax_default_prng_impl", "rbg")
        assert lsh.simhash_projections(jax.random.PRNGKey(0), 4, 2, 2).shape == (4, 4)
    finally:
        jax.config.update("jax_default_prng_impl", impl)
    with without_jaxtyping(), pytest.raises(TypeError, match="key must be one jax.random key"):
        lsh.simhash_projections(jnp.zeros(4, jnp.uint32), 4, 2, 2)  # not threefry's [2]
    k = jnp.ones((1, 1, 8, 4))
    assert quest_build_pages(k, jnp.asarray([0]), jnp.asarray([8]), 4, capacity=jnp.asarray(8)).kmin.shape[2] == 2
    state = prefill(model, [[1, 2, 3]], 4)
    from magicpig_jax.decode_loop import Sampling, start_decode

    for _ in start_decode(model, state, decode_spec(model, "dense"), 2, Sampling(), consume_prefill=True):
        pass
    for bad, err in ((None, TypeError), (state, ValueError)):
        with pytest.raises(err, match="PrefillState"):
            forced_decode(model, bad, forced_tokens=[[1, 2]], attention="dense", max_new_tokens=2)


def test_complex_inputs_are_refused_not_cast():
    """A complex array cast to float32 keeps only its real part (NumPy warns, JAX does not): the
    cosine and the merged output would be those of other vectors without a word."""
    from tests._messages import without_jaxtyping

    x = jnp.asarray([1 + 1j, 2 - 1j], jnp.complex64)
    with without_jaxtyping():
        with pytest.raises(TypeError, match="q must be a real float or integer array, got complex64"):
            lsh.collision_probability(x, jnp.ones(2))
        with pytest.raises(TypeError, match="out_b must be floating-point, got complex64"):
            merge_attention(jnp.ones((1, 2)), jnp.zeros(1), x[None], jnp.zeros(1))
        with pytest.raises(TypeError, match="lse_a must be floating-point, got int32"):
            merge_attention(jnp.ones((1, 2)), jnp.zeros(1, jnp.int32), jnp.ones((1, 2)), jnp.zeros(1))
        # integers stay accepted by the cosine (exact in float32 at these sizes)
        assert float(lsh.collision_probability(jnp.asarray([1, 0]), jnp.asarray([2, 0]))) == 1.0


def test_simhash_projections_takes_a_numpy_head_dim():
    """np.int64(4) was refused as 'must be a positive int, got np.int64(4)' (a fresh reviewer's finding);
    a float or bool head_dim is a TypeError naming its type."""
    from tests._messages import without_jaxtyping

    with without_jaxtyping():
        assert lsh.simhash_projections(jax.random.key(0), np.int64(4), 3, 2).shape == (4, 6)
        with pytest.raises(TypeError, match="head_dim must be an int, got float 4.0"):
            lsh.simhash_projections(jax.random.key(0), 4.0, 3, 2)
        with pytest.raises(ValueError, match="head_dim must be a positive int, got 0"):
            lsh.simhash_projections(jax.random.key(0), 0, 3, 2)


def test_traced_counts_past_int32_are_not_wrapped_into_range():
    """Traced int64 counts of 2**32 + 1 were cast to int32 (1): host_append appended one key without an
    error and quest_append_pages clipped 1, not max_count (a fresh reviewer's finding). They are now
    bounded in their own width, so the op refuses the first and the documented clip holds for the second."""
    from magicpig_jax import host
    from magicpig_jax.attention import MagicPIGConfig

    cfg = MagicPIGConfig(K=3, L=6, num_sink=2, num_local=4)
    with jax.enable_x64(True):
        k = jnp.asarray(np.random.default_rng(0).standard_normal((2, 2, 40, 16)), jnp.float32)
        proj = lsh.simhash_projections(jax.random.key(1), 16, 3, 6)
        idx = host.host_build_index(k, proj, cfg, jnp.asarray([30, 30], jnp.int32), capacity=40)
        counts = jnp.asarray([2**32 + 1, 1], jnp.int64)
        append = jax.jit(lambda ix, c: host.host_append(ix, k[:, :, 30:33], c))
        with pytest.raises(Exception, match=r"counts\[0\] = 4 must be in \[0, T=3\]"):
            np.asarray(append(idx, counts).bounds)
        ok = append(idx, jnp.asarray([3, 1], jnp.int64))
        end = np.asarray(idx.bounds)[:, 1]
        assert np.asarray(ok.bounds)[:, 1].tolist() == [end[0] + 3, end[1] + 1]
        kq = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, 64, 8)), jnp.float32)
        pages = host.quest_build_pages(kq, jnp.zeros(2, jnp.int32), jnp.asarray([20, 20], jnp.int32), page_size=4,
                                       capacity=64)
        grow = jax.jit(lambda p, c: host.quest_append_pages(p, kq, c, 8))
        for c in ([9, 1], [2**32 + 1, 1], [2**31, 1]):  # each clipped to max_count 8 (were 28, 21 and 20)
            assert np.asarray(grow(pages, jnp.asarray(c, jnp.int64)).end).tolist() == [28, 21]


def test_wide_lengths_and_counts_are_clipped_before_the_int32_cast():
    """quest_pages_kept/quest_rows_read and MagicPIGConfig.hashed_range cast a uint32 3e9 to int32 first
    (-1294967296), and quest_append_pages skipped its check of NumPy counts when the pages were traced
    (2**32 + 1 wrapped to 1): a re-reviewer's findings."""
    from magicpig_jax import host
    from magicpig_jax.attention import MagicPIGConfig
    from magicpig_jax.attention.baselines import quest_pages_kept, quest_rows_read
    from tests._messages import without_jaxtyping

    big = np.array([3_000_000_000, 100], np.uint32)
    with without_jaxtyping():
        for lengths in (big, jnp.asarray(big)):
            assert np.asarray(quest_rows_read(1.0, lengths, 16)).tolist() == [2**31 - 1, 100]
            assert np.asarray(quest_pages_kept(1.0, lengths, 16)).tolist() == [2**27, 7]
            start, end = MagicPIGConfig(num_sink=2, num_local=4).hashed_range(lengths)
            assert np.asarray(start).tolist() == [2, 2] and np.asarray(end).tolist() == [2**31 - 5, 96]
    kq = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, 64, 8)), jnp.float32)
    pages = host.quest_build_pages(kq, jnp.zeros(2, jnp.int32), jnp.asarray([20, 20], jnp.int32), page_size=4,
                                   capacity=64)
    for counts in (np.array([2**32 + 1, 1], np.int64), np.array([9, 1])):
        with pytest.raises(ValueError, match=r"counts must be int \[B\] = \[2\] in \[0, max_count = 8\]"):
            jax.jit(lambda p, c=counts: host.quest_append_pages(p, kq, c, 8))(pages)


def test_float_lengths_and_counts_are_refused_not_cut_or_wrapped():
    """A float lengths array reached quest_pages_kept/quest_rows_read, MagicPIGConfig.hashed_range and
    decode_range_lengths once they clipped before checking: 10.7 read as 10, and a float32 3e9,
    clipped to 2**31 - 1 (which rounds to 2**31), wrapped to -2**31 (start -2147483648); float counts
    were cut (2.5 appended 2 keys). A re-reviewer's findings."""
    from magicpig_jax import host
    from magicpig_jax.attention import MagicPIGConfig
    from magicpig_jax.attention.baselines import quest_pages_kept, quest_rows_read
    from magicpig_jax.models.backends.spec import decode_range_lengths
    from tests._messages import without_jaxtyping

    with without_jaxtyping():
        for lengths in (np.array([10.7, 3e9], np.float32), jnp.array([10.7, 3e9], jnp.float32)):
            for fn in (lambda n: quest_pages_kept(0.5, n, 4), lambda n: quest_rows_read(0.5, n, 4),
                       MagicPIGConfig().hashed_range, lambda n: decode_range_lengths(n, 4)):
                with pytest.raises(TypeError, match="lengths must be an integer array, got float32"):
                    fn(lengths)
        kq = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1, 64, 8)), jnp.float32)
        pages = host.quest_build_pages(kq, jnp.zeros(2, jnp.int32), jnp.asarray([20, 20], jnp.int32), page_size=4,
                                       capacity=64)
        with pytest.raises(TypeError, match="counts must be an integer array, got float"):
            host.quest_append_pages(pages, kq, np.array([2.5, 1.0]), 8)
