"""load_model / build_llama hold each GGUF matrix once, as the file's rows (issue 14): a tiny
Llama of random K-quant blocks in llama.cpp's Q4_K_M layout (tools/make_random_gguf.py) loads
with no float32 matrix, computes what its float32 dequantization computes, survives an orbax
checkpoint, and reads its tensors lazily."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from magicpig_jax.eval.forcing import forced_decode
from magicpig_jax.generation import prefill
from magicpig_jax.io.checkpoint import MARKER, save_checkpoint
from magicpig_jax.io.gguf_model import GGUFWeights, packed_key, read_gguf, split_packed_key
from magicpig_jax.io.loader import convert_model, load_model

ROOT = Path(__file__).resolve().parent.parent


def _tool():
    spec = importlib.util.spec_from_file_location("make_random_gguf", ROOT / "tools" / "make_random_gguf.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)  # dataclasses look their module up
    spec.loader.exec_module(sys.modules[spec.name])
    return sys.modules[spec.name]


@pytest.fixture(scope="module")
def q4km(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-q4km.gguf"
    return _tool().write_random_gguf(path, "tiny", "Q4_K_M", seed=3)


def _float32_matrices(module) -> list[str]:
    return [jax.tree_util.keystr(p) for p, x in jax.tree_util.tree_leaves_with_path(nnx.state(module))
            if x.dtype == jnp.float32 and x.ndim == 2]


def _decode_logits(model, state, steps=4):
    seen = []
    toks, _ = forced_decode(model, state, attention="dense", max_new_tokens=steps, stop_on_eos=False,
                            logits_callback=lambda i, lg: seen.append(np.asarray(lg)))
    return toks, np.stack(seen)


def test_q4_k_m_layout_is_held_as_rows(q4km):
    tool = _tool()
    assert [tool.use_more_bits(i, 32) for i in range(32)].count(True) == 16  # half of an 8B's layers
    model = load_model(q4km)
    m = model.module
    assert _float32_matrices(m) == []
    assert m.embed_qtype == "Q4_K" and m.embed_tokens is None and m.lm_head.qtype == "Q6_K"
    l0, l1 = m.layers
    assert l0.self_attn.qkv_qtype == "Q4_K" and l0.mlp.gate_up_qtype == "Q4_K" and l0.mlp.down_proj.qtype == "Q4_K"
    # layer 1 (the last eighth) has Q6_K v and down: q/k/v are not one type, so they stay apart
    assert l1.self_attn.qkv_packed is None and l1.self_attn.v_proj.qtype == "Q6_K"
    assert l1.self_attn.q_proj.qtype == "Q4_K" and l1.mlp.down_proj.qtype == "Q6_K"


def test_rows_compute_what_their_float32_dequantization_computes(q4km):
    rows, floats = load_model(q4km), load_model(q4km, packed_weights=False)
    assert floats.module.layers[0].self_attn.q_proj.kernel is not None
    ids = list(range(5, 300))  # two prefill chunks
    states = [prefill(m, [ids], 4) for m in (rows, floats)]
    np.testing.assert_allclose(np.asarray(states[0].last_logits), np.asarray(states[1].last_logits),
                               atol=1e-4, rtol=0)
    (t_rows, lg_rows), (t_float, lg_float) = (_decode_logits(m, states[1]) for m in (rows, floats))
    assert t_rows == t_float
    np.testing.assert_allclose(lg_rows, lg_float, atol=1e-4, rtol=0)


def test_checkpoints_keep_the_rows_and_read_version_1(q4km, tmp_path):
    ckpt = convert_model(q4km, tmp_path / "v2")
    again = load_model(ckpt)
    assert _float32_matrices(again.module) == []
    model = load_model(q4km)
    np.testing.assert_array_equal(np.asarray(again.module.layers[0].self_attn.qkv_packed[...]),
                                  np.asarray(model.module.layers[0].self_attn.qkv_packed[...]))
    # version 1 held a float32 copy beside the rows: both load, the rows win unless packed_weights=False
    config, weights, meta, freq = read_gguf(q4km)
    both = dict(weights)
    for key in list(weights):
        name, qtype = split_packed_key(key)
        if qtype is not None:
            both[name] = np.asarray(gguf.quants.dequantize(weights[key], gguf.GGMLQuantizationType[qtype]), np.float32)
    v1 = save_checkpoint(tmp_path / "v1", config, both, model.tokenizer, freq)
    marker = json.loads((v1 / MARKER).read_text())
    marker["format_version"] = 1
    (v1 / MARKER).write_text(json.dumps(marker))
    old = load_model(v1)
    assert _float32_matrices(old.module) == [] and old.module.lm_head.qtype == "Q6_K"
    assert load_model(v1, packed_weights=False).module.lm_head.packed is None


def test_gguf_weights_are_read_when_accessed(q4km):
    _, weights, _, _ = read_gguf(q4km)
    assert isinstance(weights, GGUFWeights)
    key = packed_key("model.layers.0.mlp.down_proj.weight", "Q4_K")
    assert weights.qtype(key) == "Q4_K" and key in weights
    rows = weights[key]
    assert rows.dtype == np.uint8 and rows.shape == (256, 512 // 256 * 144)
    reader = gguf.GGUFReader(str(q4km))
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    np.testing.assert_array_equal(rows, np.asarray(raw.data))
    assert weights["model.norm.weight"].dtype == np.float32
    n = len(weights)
    del weights[key]
    assert key not in weights and len(weights) == n - 1
    with pytest.raises(TypeError, match="read-only"):
        weights[key] = rows


def test_gemma3_shaped_random_gguf_loads_as_rows_and_decodes(tmp_path):
    """The tool's gemma3 shape (what bench runs use for Gemma-3-1B): its Q4_K_M rows held as they
    are, the layers llama.cpp slides windowed, and its rows compute what their float32
    dequantization computes (the sandwich and q/k norms included)."""
    path = _tool().write_random_gguf(tmp_path / "g.gguf", "gemma3-tiny", "Q4_K_M", seed=1)
    rows, floats = load_model(path), load_model(path, packed_weights=False)
    assert _float32_matrices(rows.module) == [] and rows.config.windowed_layers == (0, 1, 2, 3, 4)
    assert rows.config.sandwich_norms and rows.config.hidden_act == "gelu_tanh"
    ids = list(range(5, 60))
    states = [prefill(m, [ids], 4) for m in (rows, floats)]
    np.testing.assert_allclose(np.asarray(states[0].last_logits), np.asarray(states[1].last_logits),
                               atol=1e-4, rtol=0)
    (t_rows, lg_rows), (t_float, lg_float) = (_decode_logits(m, states[1]) for m in (rows, floats))
    assert t_rows == t_float and np.isfinite(lg_rows).all()
    np.testing.assert_allclose(lg_rows, lg_float, atol=1e-4, rtol=0)


def test_the_plain_view_reader_parses_what_gguf_parses(q4km):
    """The reader's faster ``_get`` (gguf_model._reader_class) gives gguf.GGUFReader's own fields and
    tensors, for the embedded model (a vocabulary of 49,152 strings and its merges) and a random
    Q4_K_M file: names, types, offsets, each part's bytes and dtype, the tensors' data."""
    from magicpig_jax.io.embedded import embedded_model_path
    from magicpig_jax.io.gguf_model import _reader_class

    for path in (embedded_model_path(), q4km):
        want, got = gguf.GGUFReader(str(path)), _reader_class()(str(path))
        assert isinstance(got, gguf.GGUFReader) and list(got.fields) == list(want.fields), path
        for name, f in want.fields.items():
            g = got.fields[name]
            assert (g.offset, g.data, g.types) == (f.offset, f.data, f.types), name
            assert len(g.parts) == len(f.parts), name
            for a, b in zip(g.parts, f.parts, strict=True):
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
        assert len(got.tensors) == len(want.tensors) > 0
        for a, b in zip(got.tensors, want.tensors, strict=True):
            assert (a.name, a.tensor_type, a.shape.tolist(), a.n_elements, a.n_bytes, a.data_offset) == (
                b.name, b.tensor_type, b.shape.tolist(), b.n_elements, b.n_bytes, b.data_offset)
            assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
            assert np.shares_memory(a.data, got.data)  # a view of the mapped file, not a copy
            assert a.data.tobytes() == b.data.tobytes(), a.name


def test_a_config_read_hands_its_parse_to_the_load_that_follows(q4km, tmp_path, monkeypatch):
    """The CLI reads a model's config, then loads it: the header is parsed once, the parse is not kept
    after the load, and a file changed in between (or another file) is parsed again."""
    import os
    import shutil

    from magicpig_jax.io import gguf_model as gm

    base, opened = gm._reader_class(), []

    class Counting(base):
        def __init__(self, path, *a, **k):
            opened.append(Path(path).name)
            super().__init__(path, *a, **k)

    monkeypatch.setattr(gm, "_READER", Counting)
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(q4km, copy)
    config = gm.read_gguf_config(q4km)
    assert gm.read_gguf(q4km)[0] == config and opened == [q4km.name]
    assert gm._PARSED == {}  # handed over, not kept
    gm.read_gguf(q4km)
    assert opened == [q4km.name] * 2  # a load alone parses
    gm.read_gguf_config(q4km)
    gm.read_gguf(copy)  # another file: parsed, and the first parse dropped
    assert opened == [q4km.name] * 3 + [copy.name] and gm._PARSED == {}
    gm.read_gguf_config(copy)
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # rewritten since
    gm.read_gguf(copy)
    assert opened == [q4km.name] * 3 + [copy.name] * 3


def test_random_q4_k_m_quantizes_a_tied_embedding_as_the_output_and_every_type_to_scale():
    """llama.cpp's llama_tensor_get_type gives token_embd.weight the output's type when the output is
    tied to it (Q6_K; Q8_0 when a row is no whole number of 256-weight blocks): the tool wrote Q4_K /
    Q5_0. Its Q6_K weights had an RMS of 0.17 against the documented order of 0.02 (gguf-py's
    dequantization as the reference)."""
    import gguf

    tool = _tool()
    for shape, want in (("llama3-1b", "Q6_K"), ("gemma2-2b", "Q6_K"), ("smollm2-135m", "Q8_0"),
                        ("gemma3-1b", "Q8_0"), ("llama3-8b", "Q4_K"), ("tiny", "Q4_K")):
        s = tool.SHAPES[shape]
        assert tool.tensor_type("token_embd.weight", None, s, "Q4_K_M", s.hidden) == want, shape
    rng = np.random.default_rng(0)
    for qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16"):
        w = gguf.quants.dequantize(tool.random_tensor(rng, qtype, 64, 512), gguf.GGMLQuantizationType[qtype])
        assert 0.008 < float(np.sqrt(np.mean(np.square(w)))) < 0.05, qtype
