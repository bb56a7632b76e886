"""generate(): prompt forms, batches, every backend with its parameters, stop strings, streaming, stats."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import jax.numpy as jnp
import pytest

from magicpig_jax import generate, load_model
from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.generation import encode_prompt

FAMILY = Path(__file__).parent / "fixtures" / "families" / "qwen2"
SMALL = MagicPIGConfig(K=4, L=8, num_sink=2, num_local=4)


@pytest.fixture(scope="module")
def model():
    return load_model(FAMILY)


def test_string_and_one_message_are_the_same_prompt(model):
    assert encode_prompt(model, "hi there") == encode_prompt(model, [{"role": "user", "content": "hi there"}])
    a = generate(model, "hi there", attention="dense", max_new_tokens=5)
    b = generate(model, [{"role": "user", "content": "hi there"}], attention="dense", max_new_tokens=5)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 5 and a.stop_reason == "length"


def test_batch_rows_equal_the_rows_alone(model):
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    rows = generate(model, ["one two three", conv], attention="dense", max_new_tokens=4)
    assert isinstance(rows, list) and len(rows) == 2
    assert rows[0].token_ids == generate(model, "one two three", attention="dense", max_new_tokens=4).token_ids
    assert rows[1].token_ids == generate(model, conv, attention="dense", max_new_tokens=4).token_ids


@pytest.mark.parametrize("attention,kw", [("topk", {"budget": 4}), ("quest", {"budget": 0.5, "page_size": 2}),
                                          ("oracle", {"budget": 8}), ("magicpig", {}), ("magicpig-ref", {})])
def test_every_backend_is_reachable_with_its_parameters(model, attention, kw):
    prompt = "count: " + " ".join(str(i) for i in range(40))
    got = generate(model, prompt, attention=attention, config=SMALL, dense_layers=(), max_new_tokens=3, **kw)
    assert len(got.token_ids) == 3 and got.stats["attention"] == attention
    assert got.stats["budget"] == kw.get("budget")
    assert got.stats["index_build_seconds"] is not None


def test_budgeted_backend_without_budget_names_it(model):
    with pytest.raises(ValueError, match="budget"):
        generate(model, "hi", attention="topk")


def test_options_that_would_be_ignored_are_refused(model):
    """As the CLI refuses their flags: top_p with greedy decoding (dense_layers and config stay accepted
    with attention 'dense', so that one loop with the same arguments compares backends), a budget that
    int32 would wrap."""
    with pytest.raises(ValueError, match=r"^top_p applies to sampling only; with temperature 0 decoding is greedy"):
        generate(model, "hi", attention="dense", top_p=0.5)
    with pytest.raises(ValueError, match=r"budget as a token count must be <= 2147483647"):
        generate(model, "hi", attention="topk", budget=2**32 + 1)


def test_stop_string_cuts_the_text_and_reports_stop(model):
    full = generate(model, "hi there", attention="dense", max_new_tokens=8)
    assert len(full.text) > 2
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 2]
    got = generate(model, "hi there", attention="dense", max_new_tokens=8, stop=[stop])
    assert got.stop_reason == "stop" and got.text == full.text[:full.text.index(stop)]
    assert got.stats["stop"] == [stop]
    # a special token's text never appears in the decoded text (it leaves them out): refused, not ignored
    with pytest.raises(ValueError, match=r"stop string 'x<\|im_start\|>' holds the special token '<\|im_start\|>'"):
        generate(model, "hi there", attention="dense", max_new_tokens=8, stop=["ok", "x<|im_start|>"])


def test_stream_joins_to_the_text(model):
    whole = generate(model, "hi there", attention="magicpig", config=SMALL, dense_layers=(), max_new_tokens=7)
    pieces = list(generate(model, "hi there", attention="magicpig", config=SMALL, dense_layers=(),
                           max_new_tokens=7, stream=True))
    assert "".join(pieces) == whole.text and len(pieces) >= 1


def test_stats_record_what_was_asked_as_strict_json(model):
    got = generate(model, "hi", attention="dense", max_new_tokens=1, temperature=0.5, top_p=0.9, seed=3)
    s = json.loads(json.dumps(got.stats, allow_nan=False))
    assert s["model"] == str(FAMILY) and s["max_new_tokens"] == 1 and s["stop_reasons"] == ["length"]
    assert s["sampling"] == {"temperature": 0.5, "top_p": 0.9, "seed": 3}
    assert s["index_build_seconds"] is None and s["decode_tokens_per_s"] is None


@pytest.mark.parametrize("prompt,match", [([{"role": "wizard", "content": "x"}], "role"),
                                          ([{"content": "x"}], "role"),
                                          (42, "prompt must be")])
def test_malformed_prompts_are_refused(model, prompt, match):
    with pytest.raises((TypeError, ValueError), match=match):
        generate(model, prompt, attention="dense", max_new_tokens=1)


def test_stream_takes_one_prompt(model):
    with pytest.raises(ValueError, match="one prompt"):
        generate(model, ["a", "b"], stream=True)


def test_generate_shows_its_real_signature_and_documents_every_parameter():
    import magicpig_jax

    params = inspect.signature(magicpig_jax.generate).parameters
    assert list(params)[:2] == ["model", "prompt"]
    for name in ("attention", "max_new_tokens", "config", "dense_layers", "budget", "page_size", "temperature",
                 "top_p", "seed", "stop", "stream", "chat", "parse_special", "kv_dtype"):
        assert name in params, name
    doc = inspect.getdoc(magicpig_jax.generate)
    undocumented = [n for n in params if not any(line.lstrip().startswith((f"{n}:", f"{n},")) or f", {n}" in
                                                 line.split(":")[0] for line in doc.splitlines())]
    assert undocumented == []


def test_load_model_takes_the_loaders_options(tmp_path):
    """``magicpig_jax.load_model(path, packed_weights=False)``: float32 matrices, the same greedy tokens."""
    import magicpig_jax
    from tests.fixtures.gguf_convert import write_gguf

    assert "packed_weights" in inspect.signature(magicpig_jax.load_model).parameters
    gguf = write_gguf(FAMILY, tmp_path / "qwen2.gguf", pre="qwen2")  # F16 matrices: held as the file's rows
    packed = magicpig_jax.load_model(gguf)
    floats = magicpig_jax.load_model(gguf, packed_weights=False)
    assert not [x for x in jax_leaves(floats.module) if x.dtype == jnp.uint8]  # no GGUF rows: float32 copies
    assert [x for x in jax_leaves(packed.module) if x.dtype == jnp.uint8]  # the file's rows
    a = generate(packed, "hi there", attention="dense", max_new_tokens=4)
    b = generate(floats, "hi there", attention="dense", max_new_tokens=4)
    assert a.token_ids == b.token_ids


def jax_leaves(module):
    import jax
    from flax import nnx

    return jax.tree.leaves(nnx.state(module))


def test_a_sparse_attention_with_every_layer_dense_warns(model):
    """The qwen2 fixture has 2 layers: the default dense layers (0 and num_layers // 2) are both, so
    'magicpig' decodes exactly as dense; the API says so, as the CLI's note does, and the tokens are dense's."""
    with pytest.warns(UserWarning, match=r"every layer of this 2-layer model is dense \(dense layers \(0, 1\)\)"):
        got = generate(model, "hi there", attention="magicpig", config=SMALL, max_new_tokens=3)
    assert got.token_ids == generate(model, "hi there", attention="dense", max_new_tokens=3).token_ids
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one sparse layer: no warning
        generate(model, "hi there", attention="magicpig", config=SMALL, dense_layers=(0,), max_new_tokens=3)
        generate(model, "hi there", attention="dense", max_new_tokens=3)
    from magicpig_jax.attention import LayerConfigs

    all_dense = LayerConfigs(layers=((0, "dense"), (1, "dense")))
    with pytest.warns(UserWarning, match="the LayerConfigs keep every layer dense"):
        generate(model, "hi there", attention="magicpig", config=all_dense, max_new_tokens=2)


def test_options_that_would_do_nothing_or_are_mistyped_are_refused(model):
    """A seed where nothing draws (greedy, not oracle), a ``sampling`` that is not a Sampling, a
    prefill budget that is not an int: named errors, before any work."""
    from magicpig_jax.decode_loop import Sampling
    from magicpig_jax.generation import decode, prefill

    with pytest.raises(ValueError, match="seed has no effect here: decoding is greedy"):
        generate(model, "hi", attention="dense", max_new_tokens=1, seed=7)
    assert generate(model, "hi", attention="dense", max_new_tokens=1, temperature=0.5, seed=7).stats["sampling"][
        "seed"] == 7
    assert generate(model, "hi", attention="dense", max_new_tokens=1).stats["sampling"]["seed"] == 0
    ids = encode_prompt(model, "hi", True, False)
    for bad in (1.5, None, True):
        with pytest.raises(TypeError, match=f"max_new_tokens must be an int, got {bad!r}"):
            prefill(model, [ids], bad)
    state = prefill(model, [ids], 2)
    with pytest.raises(TypeError, match="sampling must be a Sampling .* got dict"):
        decode(model, state, attention="dense", max_new_tokens=1, sampling={"temperature": 1.0})
    assert decode(model, state, attention="dense", max_new_tokens=1, sampling=Sampling())
    with pytest.raises(ValueError, match="^the prompt encodes to no token"):
        generate(model, "", chat=False, attention="dense", max_new_tokens=1)
    with pytest.raises(ValueError, match="^prompt 1 encodes to no token"):
        generate(model, ["a", ""], chat=False, attention="dense", max_new_tokens=1)
