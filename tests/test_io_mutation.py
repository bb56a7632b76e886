"""The loaders' pure-Python facts (``magicpig_jax.io``) against independent references: the GGUF
block table of :mod:`magicpig_jax.io.gguf_blocks` against gguf-py's ``GGML_QUANT_SIZES`` and
type ids, row sizes by hand and as a round trip (hypothesis), and the exact messages.

Written for mutation testing (docs/mutation.md, "host/ and io/").
"""

from __future__ import annotations

import re

import gguf
import pytest
from gguf.constants import GGML_QUANT_SIZES
from hypothesis import given
from hypothesis import strategies as st

from magicpig_jax.io import gguf_blocks
from magicpig_jax.io.gguf_blocks import (
    BLOCK_SIZE,
    QUANT_TYPES,
    block_bytes,
    block_weights,
    packed_row_bytes,
    row_weights,
)


def _exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def test_quant_types_are_gguf_pys():
    assert sorted(QUANT_TYPES) == ["BF16", "F16", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"]
    assert BLOCK_SIZE == 32
    for name, (type_id, nbytes, nweights) in QUANT_TYPES.items():
        t = gguf.GGMLQuantizationType[name]
        assert type_id == int(t), name
        assert (nweights, nbytes) == GGML_QUANT_SIZES[t], name
        assert block_bytes(name) == nbytes and block_weights(name) == nweights


def test_row_sizes_by_hand_and_messages():
    assert packed_row_bytes("Q4_1", 64) == 40
    assert packed_row_bytes("Q6_K", 512) == 420
    assert packed_row_bytes("F16", 3) == 6
    assert row_weights("Q4_1", 40) == 64
    assert row_weights("Q6_K", 420) == 512
    assert row_weights("BF16", 6) == 3
    bad_type = "qtype must be one of ['BF16', 'F16', 'Q4_0', 'Q4_1', 'Q4_K', 'Q5_0', 'Q5_1', 'Q5_K', 'Q6_K', " \
               "'Q8_0'], got 'Q2_K'"
    for f in (block_bytes, block_weights):
        with pytest.raises(ValueError, match=_exact(bad_type)):
            f("Q2_K")
    with pytest.raises(ValueError, match=_exact(bad_type)):
        packed_row_bytes("Q2_K", 32)
    with pytest.raises(ValueError, match=_exact(bad_type)):
        row_weights("Q2_K", 20)
    for n in (0, -32, 48, 32.0, True):
        message = f"in_features must be a positive multiple of 32 for Q8_0, got {n!r}"
        with pytest.raises(ValueError, match=_exact(message)):
            packed_row_bytes("Q8_0", n)
    for n in (0, -34, 35, 34.0):
        with pytest.raises(ValueError, match=_exact(f"a packed Q8_0 row must be a positive multiple of 34 bytes, "
                                                    f"got {n!r}")):
            row_weights("Q8_0", n)
    assert gguf_blocks.row_weights("F16", 2) == 1 and gguf_blocks.packed_row_bytes("F16", 1) == 2


@given(st.sampled_from(sorted(QUANT_TYPES)), st.integers(1, 64))
def test_row_sizes_round_trip(qtype, blocks):
    nweights, nbytes = GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    assert packed_row_bytes(qtype, blocks * nweights) == blocks * nbytes
    assert row_weights(qtype, blocks * nbytes) == blocks * nweights
    assert type(packed_row_bytes(qtype, blocks * nweights)) is int and type(row_weights(qtype, nbytes)) is int


# -- chat_template -------------------------------------------------------------------------------

_ONE = [{"role": "user", "content": "x"}]  # a conversation holds at least one message


def test_chat_template_tojson_passes_its_arguments_to_json_dumps():
    import json

    from magicpig_jax.io.chat_template import render_chat_template

    data = {"b": "é", "a": [1, 2]}
    cases = [("", {}), ("indent=2", {"indent": 2}), ("separators=(',', ':')", {"separators": (",", ":")}),
             ("sort_keys=true", {"sort_keys": True}), ("ensure_ascii=true", {"ensure_ascii": True})]
    for args, kw in cases:
        template = "{{ data | tojson(" + args + ") }}"
        assert render_chat_template(template, _ONE, data=data) == json.dumps(data, **{"ensure_ascii": False, **kw})


def test_chat_template_errors_name_the_error_type_and_message():
    from magicpig_jax.io.chat_template import ChatTemplateError, render_chat_template

    with pytest.raises(ChatTemplateError, match=_exact("the chat template failed: TemplateError: no system role")):
        render_chat_template("{{ raise_exception('no system role') }}", _ONE)
    # a Python error while rendering (not a Jinja one) is named by its type too
    with pytest.raises(ChatTemplateError, match=_exact("the chat template failed: ZeroDivisionError: integer division "
                                                       "or modulo by zero")):
        render_chat_template("{{ n // 0 }}", _ONE, n=1)


def test_chat_template_variables_and_the_generation_tag():
    from magicpig_jax.io.chat_template import render_chat_template

    messages = ({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"})  # any sequence
    template = ("{{ messages | length }}{% for m in messages %}[{% generation %}{{ m.content }}{% endgeneration %}]"
                "{% endfor %}{{ add_generation_prompt }}")
    assert render_chat_template(template, messages) == "2[a][b]True"
    assert render_chat_template(template, messages, add_generation_prompt=False) == "2[a][b]False"
    both = "{{ bos_token is defined }} {{ eos_token is defined }}"
    assert render_chat_template(both, _ONE) == "False False"
    assert render_chat_template(both, _ONE, bos_token="<s>") == "True False"
    assert render_chat_template(both, _ONE, eos_token="</s>") == "False True"
    assert render_chat_template("{{ bos_token }}|{{ eos_token }}|{{ tools is none }}", _ONE, bos_token="<s>",
                                eos_token="</s>") == "<s>|</s>|True"
    assert render_chat_template("{{ tools }} {{ documents }}", _ONE, tools=[1]) == "[1] None"


# -- hf_model ------------------------------------------------------------------------------------


def _hf_dir(tmp_path, files: dict, generation=None, tie=True, eos=(1, 4, 5)):
    """A Hugging Face directory: the llama3 family's config.json (tie and eos replaced) and safetensors files
    written by safetensors' NumPy API."""
    import json
    from pathlib import Path

    from safetensors.numpy import save_file

    cfg = json.loads((Path(__file__).parent / "fixtures" / "families" / "llama3" / "config.json").read_text())
    cfg["tie_word_embeddings"], cfg["eos_token_id"] = tie, list(eos)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    for name, tensors in files.items():
        save_file(tensors, str(tmp_path / name))
    return tmp_path


def test_read_generation_eos_ids_by_hand(tmp_path):
    import json

    from magicpig_jax.io.hf_model import read_generation_eos_ids

    assert read_generation_eos_ids(tmp_path) == ()
    for contents, expect in (({}, ()), ({"eos_token_id": None}, ()), ({"eos_token_id": 7}, (7,)),
                             ({"eos_token_id": [3, 9]}, (3, 9)), ({"eos_token_id": "5"}, (5,))):
        (tmp_path / "generation_config.json").write_text(json.dumps(contents))
        got = read_generation_eos_ids(str(tmp_path))
        assert got == expect and all(type(e) is int for e in got)


def test_read_hf_dir_weights_ties_stop_ids_and_messages(tmp_path):
    import numpy as np

    from magicpig_jax.io.hf_model import read_hf_dir
    from magicpig_jax.models.config import UnsupportedConfigError

    rng = np.random.default_rng(0)
    embed = rng.normal(size=(6, 4)).astype(np.float16)
    other = rng.normal(size=(3, 4)).astype(np.float32)
    d = tmp_path / "a"
    d.mkdir()
    _hf_dir(d, {}, generation={"eos_token_id": [4, 9, 1, 11]})
    with pytest.raises(FileNotFoundError, match=_exact(f"no *.safetensors files in {d}")):
        read_hf_dir(d)
    # a rotary buffer before another weight of its file (skipped, the rest of the file read)
    _hf_dir(d, {"b.safetensors": {"model.embed_tokens.weight": embed, "lm_head.weight": embed.copy()},
                "a.safetensors": {"model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(2, np.float32),
                                  "model.norm.weight": other}})
    config, weights = read_hf_dir(str(d))
    assert config.eos_token_ids == (1, 4, 5, 9, 11)  # config.json's, then generation_config.json's new ones
    # inv_freq and the tied head dropped; the float16 matrix held as its F16 rows, the float32 vector as it is
    assert sorted(weights) == ["model.embed_tokens.weight_f16", "model.norm.weight"]
    rows = weights["model.embed_tokens.weight_f16"]
    assert rows.dtype == np.uint8 and rows.shape == (6, 8)
    np.testing.assert_array_equal(rows.view(np.float16), embed)
    assert weights["model.norm.weight"].dtype == np.float32
    np.testing.assert_array_equal(weights["model.norm.weight"], other)
    # untied: the head is kept; a float16 vector becomes float32
    e = tmp_path / "e"
    e.mkdir()
    _hf_dir(e, {"m.safetensors": {"model.embed_tokens.weight": embed, "lm_head.weight": other,
                                  "model.norm.weight": embed[0]}}, tie=False)
    held = read_hf_dir(e)[1]
    assert sorted(held) == ["lm_head.weight", "model.embed_tokens.weight_f16", "model.norm.weight"]
    assert held["lm_head.weight"].dtype == held["model.norm.weight"].dtype == np.float32
    # tied but different, or tied without an embedding
    for name, tensors in (("f", {"model.embed_tokens.weight": embed, "lm_head.weight": embed * 2}),
                          ("g", {"lm_head.weight": embed})):
        (tmp_path / name).mkdir()
        _hf_dir(tmp_path / name, {"m.safetensors": tensors})
        with pytest.raises(UnsupportedConfigError, match=_exact(
                f"{tmp_path / name}: tie_word_embeddings is true but lm_head.weight differs from "
                "model.embed_tokens.weight")):
            read_hf_dir(tmp_path / name)
    h = tmp_path / "h"
    h.mkdir()
    _hf_dir(h, {"1.safetensors": {"model.norm.weight": other}, "2.safetensors": {"model.norm.weight": other}})
    with pytest.raises(ValueError, match=_exact(f"weight 'model.norm.weight' appears in more than one safetensors "
                                                f"file of {h}")):
        read_hf_dir(h)
    with pytest.raises(FileNotFoundError, match=_exact(f"{tmp_path / 'none' / 'config.json'} not found: a Hugging "
                                                       "Face model directory needs config.json")):
        read_hf_dir(tmp_path / "none")


# -- checkpoint ------------------------------------------------------------------------------------


def test_checkpoint_round_trip_defaults_and_messages(tmp_path):
    import dataclasses
    import json
    from pathlib import Path

    import numpy as np

    from magicpig_jax.io import checkpoint
    from magicpig_jax.io.hf_model import read_hf_dir
    from magicpig_jax.io.tokenizer import Tokenizer

    family = Path(__file__).parent / "fixtures" / "families" / "llama3"
    config, _ = read_hf_dir(family)  # llama3 RoPE scaling: a tuple of (key, value) pairs
    assert config.rope_scaling is not None
    tok = Tokenizer.from_hf_dir(family, eos_token_ids=(1, 4))
    rng = np.random.default_rng(1)
    weights = {"model.embed_tokens.weight": rng.normal(size=(5, 3)).astype(np.float16),
               "model.layers.0.mlp.up_proj.weight": rng.normal(size=(2, 3)),  # float64: saved as float32
               "model.layers.0.mlp.down_proj.weight.q4_1": rng.integers(0, 256, (2, 20), dtype=np.uint8)}
    freq = np.array([1.0, 0.5, 0.25], np.float64)
    out = tmp_path / "a" / "b"  # parents are created
    assert not checkpoint.is_checkpoint(out)
    assert checkpoint.save_checkpoint(out, config, weights, tok, freq) == out.absolute()
    assert checkpoint.is_checkpoint(str(out)) and (out / checkpoint.MARKER).is_file()
    meta = json.loads((out / checkpoint.MARKER).read_text())
    assert meta["format_version"] == 6 and "source_sha1" not in meta  # recorded only when given (convert)
    with pytest.raises(TypeError, match="source_sha1 must be a str"):
        checkpoint.save_checkpoint(tmp_path / "typed", config, weights, tok, source_sha1=5)
    assert checkpoint.read_checkpoint_config(out) == config
    cfg, got, tok2, freq2 = checkpoint.read_checkpoint(str(out))
    assert cfg == config and sorted(got) == sorted(weights)
    for name, w in weights.items():
        want = w if w.dtype == np.uint8 else w.astype(np.float32)
        assert got[name].dtype == want.dtype, name
        np.testing.assert_array_equal(got[name], want)
    assert freq2.dtype == np.float32
    np.testing.assert_array_equal(freq2, freq.astype(np.float32))
    for attr in ("chat_template", "eos_token_ids", "bos_token_id", "eos_token_id", "add_bos_token", "add_eos_token"):
        assert getattr(tok2, attr) == getattr(tok, attr), attr
    assert tok2.chat_template and tok2.eos_token_ids[:2] == (1, 4)
    assert tok2.encode("hello there") == tok.encode("hello there")
    # the weights are stored under their names with "/" for "." (orbax's nested keys: the on-disk format)
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        stored = ckpt.restore(out.absolute() / "weights")
    assert sorted(stored) == sorted([k.replace(".", "/") for k in weights] + ["rope_freqs"])
    # a tokenizer that adds EOS, saved into an existing empty directory
    tok_eos = Tokenizer(tok.backend, chat_template=None, eos_token_ids=(4,), add_eos_token=True)
    (tmp_path / "empty").mkdir()
    checkpoint.save_checkpoint(tmp_path / "empty", config, {"w": np.ones((2, 2), np.float32)}, tok_eos)
    tok4 = checkpoint.read_checkpoint(tmp_path / "empty")[2]
    assert (tok4.add_eos_token, tok4.eos_token_id, tok4.eos_token_ids, tok4.add_bos_token) == (True, 4, (4,), False)
    with pytest.raises(FileExistsError, match=_exact(f"{out.absolute()} already holds a checkpoint; choose another OUT "
                                                     "or remove it")):
        checkpoint.save_checkpoint(out, config, weights, tok)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("x")
    with pytest.raises(FileExistsError, match=_exact(f"{(tmp_path / 'full').absolute()} exists and is not an empty "
                                                     "directory; choose another OUT")):
        checkpoint.save_checkpoint(tmp_path / "full", config, weights, tok)
    # an interrupted conversion leaves nothing at OUT, nor its partial directory
    real = checkpoint._write_checkpoint

    def interrupted(out_dir, *args):
        (out_dir / "weights").mkdir()
        raise KeyboardInterrupt

    checkpoint._write_checkpoint = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save_checkpoint(tmp_path / "cut", config, weights, tok)
    finally:
        checkpoint._write_checkpoint = real
    assert not (tmp_path / "cut").exists() and not list(tmp_path.glob(".cut*"))
    # a version-1 file without the tokenizer's fields and without rope_freqs: the defaults
    bare = tmp_path / "bare"
    checkpoint.save_checkpoint(bare, config, {"w": np.ones((2, 2), np.float32)}, tok)
    meta = json.loads((bare / checkpoint.MARKER).read_text())
    meta = {"format_version": 1, "config": {k: v for k, v in meta["config"].items() if k != "eos_token_ids"}}
    (bare / checkpoint.MARKER).write_text(json.dumps(meta))
    cfg3, got, tok3, freq3 = checkpoint.read_checkpoint(bare)
    assert cfg3.eos_token_ids == () and cfg3 == dataclasses.replace(config, eos_token_ids=())
    assert freq3 is None and sorted(got) == ["w"]
    assert (tok3.chat_template, tok3.eos_token_ids, tok3.bos_token_id, tok3.eos_token_id, tok3.add_bos_token,
            tok3.add_eos_token) == (None, (), None, None, False, False)
    meta["format_version"] = 7
    (bare / checkpoint.MARKER).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=_exact(f"unsupported checkpoint format_version 7 in {bare.absolute()}")):
        checkpoint.read_checkpoint(bare)
    with pytest.raises(ValueError, match=_exact(f"unsupported checkpoint format_version 7 in {bare.absolute()}")):
        checkpoint.read_checkpoint_config(bare)
    with pytest.raises(FileNotFoundError, match=_exact(f"{tmp_path.absolute()} is not a magicpig_jax checkpoint (no "
                                                       "magicpig_model.json)")):
        checkpoint.read_checkpoint(tmp_path)
    # a key added by hand, at the top or in the config, would be ignored: refused, named
    meta["format_version"] = 1
    for extra, message in (({"bogus": 1}, "magicpig_model.json has unknown keys ['bogus'] (known: format_version,"),
                           ({"config": {**meta["config"], "foo": 2}}, "its config has fields ['foo'] that "
                                                                      "LlamaConfig does not have")):
        (bare / checkpoint.MARKER).write_text(json.dumps({**meta, **extra}))
        for read in (checkpoint.read_checkpoint, checkpoint.read_checkpoint_config):
            with pytest.raises(ValueError, match=re.escape(f"checkpoint {bare.absolute()}: {message}")):
                read(bare)
    # a current-version file missing a config field (edited by hand): refused, not the field's default
    meta["format_version"] = checkpoint.FORMAT_VERSION
    (bare / checkpoint.MARKER).write_text(json.dumps(meta))
    for read in (checkpoint.read_checkpoint, checkpoint.read_checkpoint_config):
        with pytest.raises(ValueError, match=re.escape(f"checkpoint {bare.absolute()}: its config lacks the fields "
                                                       "['eos_token_ids'] (a default would stand in")):
            read(bare)


def test_checkpoint_damage_is_refused_and_conversions_touch_only_their_own_files(tmp_path):
    """A current-format file missing a tokenizer key (add_bos_token: the prompt lost its BOS), a boolean
    format_version (true == 1), ids outside the vocabulary, a tokenizer larger than the vocabulary,
    a weight of another dtype (cast silently) and a damaged weights store (raw tensorstore errors)
    are refused, named; save_checkpoint had deleted any '.OUT.partial' (a user's, or another run's)."""
    import json
    import shutil
    from pathlib import Path

    import numpy as np
    import orbax.checkpoint as ocp

    from magicpig_jax.io import checkpoint
    from magicpig_jax.io.digest import array_digest
    from magicpig_jax.io.loader import convert_model, load_model

    user = tmp_path / ".ck.partial"
    user.mkdir()
    (user / "important.txt").write_text("data")
    (tmp_path / "mnt").mkdir()  # an existing empty OUT receives the files; nothing is left beside or in it
    family = Path(__file__).parent / "fixtures" / "families" / "llama3"
    for out in (tmp_path / "ck", tmp_path / "mnt"):
        convert_model(family, out)
        assert checkpoint.is_checkpoint(out) and not list(out.glob(".*"))
    assert (user / "important.txt").read_text() == "data"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ck.partial", "ck", "mnt"]
    src = tmp_path / "ck"
    vocab = checkpoint.read_checkpoint_config(src).vocab_size

    def damaged(name, edit_meta=None, edit_dir=None):
        bad = tmp_path / name
        shutil.copytree(src, bad)
        if edit_meta is not None:
            meta = json.loads((bad / checkpoint.MARKER).read_text())
            edit_meta(meta)
            (bad / checkpoint.MARKER).write_text(json.dumps(meta))
        if edit_dir is not None:
            edit_dir(bad)
        return bad

    cases = [
        (damaged("nobos", lambda m: m.pop("add_bos_token")),
         "lacks the keys ['add_bos_token'], which format_version 6"),
        (damaged("true", lambda m: m.update(format_version=True)), "unsupported checkpoint format_version True"),
        (damaged("eos", lambda m: m.update(eos_token_ids=[2, 10**9])), "'eos_token_ids' [2, 1000000000] has ids "
                                                                      f"outside the model's vocabulary [0, {vocab})"),
        (damaged("bos", lambda m: m.update(bos_token_id=vocab)), f"'bos_token_id' {vocab} is outside"),
        (damaged("store", edit_dir=lambda d: shutil.rmtree(next((d / "weights").glob("ocdbt.process_*")))),
         "its weights/ store is damaged or incomplete ("),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            load_model(bad)
    # a tokenizer larger than the model's vocabulary: refused at load, as for GGUF and HF sources
    small = tmp_path / "small"
    shutil.copytree(src, small)
    meta = json.loads((small / checkpoint.MARKER).read_text())
    n_tokens = load_model(src).tokenizer.backend.get_vocab_size(with_added_tokens=True)
    meta["config"]["vocab_size"] = n_tokens - 1
    meta["bos_token_id"] = meta["eos_token_id"] = None
    meta["add_bos_token"] = meta["add_eos_token"] = False
    meta["eos_token_ids"] = meta["config"]["eos_token_ids"] = []
    (small / checkpoint.MARKER).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=re.escape(f"{small}: the tokenizer has {n_tokens} tokens but the model's "
                                                   f"vocabulary only {n_tokens - 1}")):
        load_model(small)
    # a weight stored as int32 (the writer writes float32 or uint8 rows), its digest updated to match
    retyped = tmp_path / "retyped"
    shutil.copytree(src, retyped)
    with ocp.StandardCheckpointer() as ckpt:
        tree = {k: np.asarray(v) for k, v in ckpt.restore(retyped / "weights").items()}
    key = next(k for k in tree if k.endswith("input_layernorm/weight"))
    tree[key] = tree[key].astype(np.int32)
    shutil.rmtree(retyped / "weights")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(retyped.absolute() / "weights", tree)
    meta = json.loads((retyped / checkpoint.MARKER).read_text())
    meta["weights_sha1"] = array_digest(tree)
    (retyped / checkpoint.MARKER).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=re.escape(f"weight {key.replace('/', '.')} is int32, but checkpoints hold "
                                                   "float32 or uint8")):
        load_model(retyped)



def test_every_byte_of_a_checkpoint_is_checked_and_names_round_trip(tmp_path):
    """Format 6 records a CRC-32 of every weight byte and a SHA-256 of tokenizer.json: the sampled
    weights_sha1 (64 pieces of 4 KiB per array) let a byte between its pieces through (a fresh
    reviewer flipped bytes of the embedded model's store: logits off by up to 44.7, loaded without a
    word) and tokenizer.json was never checked. A weight name that does not come back as itself
    ('/', an empty part, 'rope_freqs': the RoPE factors' key) is refused when saving. A version-4 file
    lacking a key that version always wrote, a null nope_layers and an OUT name too long for its
    partial directory are refused, named."""
    import json
    import shutil
    from pathlib import Path

    import numpy as np
    import orbax.checkpoint as ocp

    from magicpig_jax.io import checkpoint
    from magicpig_jax.io.digest import array_digest
    from magicpig_jax.io.hf_model import read_hf_dir
    from magicpig_jax.io.tokenizer import Tokenizer

    family = Path(__file__).parent / "fixtures" / "families" / "llama3"
    config, _ = read_hf_dir(family)
    tok = Tokenizer.from_hf_dir(family)
    w = np.random.default_rng(0).normal(size=(512, 1024)).astype(np.float32)  # 2 MiB: sampled, not read whole
    out = checkpoint.save_checkpoint(tmp_path / "ck", config, {"w": w}, tok)
    checkpoint.read_checkpoint(out)
    with ocp.StandardCheckpointer() as ckpt:
        tree = {k: np.asarray(v) for k, v in ckpt.restore(out / "weights").items()}
    changed = dict(tree, w=tree["w"].copy())
    changed["w"].reshape(-1)[(4096 + 100) // 4] += 1.0  # a byte between the first two sampled pieces
    assert array_digest(changed) == array_digest(tree)  # the sampled digest cannot see it
    shutil.rmtree(out / "weights")
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(out / "weights", changed)
    with pytest.raises(ValueError, match=r"records the checksum weights_crc32 [0-9a-f]{8}, but its weights give "
                                         r"[0-9a-f]{8}: damaged or replaced"):
        checkpoint.read_checkpoint(out)
    tok_out = checkpoint.save_checkpoint(tmp_path / "tok", config, {"w": w}, tok)
    text = json.loads((tok_out / "tokenizer.json").read_text())
    (tok_out / "tokenizer.json").write_text(json.dumps(text, indent=3))  # the same tokenizer, other bytes
    with pytest.raises(ValueError, match="records the checksum tokenizer.json [0-9a-f]{64}, but its tokenizer.json"):
        checkpoint.read_checkpoint(tok_out)
    for name in ("rope_freqs", "model/norm/weight", "model..norm", "model.norm.weight.", ""):
        with pytest.raises(ValueError, match=f"weight {re.escape(repr(name))} cannot be stored in a checkpoint"):
            checkpoint.save_checkpoint(tmp_path / "names", config, {name: w[:2]}, tok)
    assert not (tmp_path / "names").exists()
    # a version-4 file lacking add_bos_token (a default would stand in); without the keys 5 and 6 added: read
    v4 = checkpoint.save_checkpoint(tmp_path / "v4", config, {"w": w[:2]}, tok)
    meta = json.loads((v4 / checkpoint.MARKER).read_text())
    meta = {k: v for k, v in meta.items() if k not in ("chat_templates", "checksums")} | {"format_version": 4}
    (v4 / checkpoint.MARKER).write_text(json.dumps(meta))
    checkpoint.read_checkpoint(v4)
    (v4 / checkpoint.MARKER).write_text(json.dumps({k: v for k, v in meta.items() if k != "add_bos_token"}))
    with pytest.raises(ValueError, match=re.escape("lacks the keys ['add_bos_token'], which format_version 4 always "
                                                   "writes")):
        checkpoint.read_checkpoint(v4)
    for key, value in (("nope_layers", None), ("nope_layers", 5), ("sliding_layers", 5)):
        (v4 / checkpoint.MARKER).write_text(json.dumps({**meta, "config": {**meta["config"], key: value}}))
        with pytest.raises(ValueError, match=re.escape(f"config '{key}' must be a list of layer indices")):
            checkpoint.read_checkpoint_config(v4)
    with pytest.raises(ValueError, match="NAME may have at most 237 bytes here"):
        checkpoint.check_out_free(tmp_path / ("x" * 238))
    assert checkpoint.check_out_free(tmp_path / ("x" * 237)) == (tmp_path / ("x" * 237)).absolute()


# -- tokenizer -------------------------------------------------------------------------------------


def _llama3_backend():
    from pathlib import Path

    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(str(Path(__file__).parent / "fixtures" / "families" / "llama3" / "tokenizer.json"))


def test_tokenizer_fields_special_ids_encode_decode_and_messages():
    import numpy as np

    from magicpig_jax.io.tokenizer import Tokenizer, TokenizerMetadataError

    backend = _llama3_backend()  # <|begin_of_text|> 0, <|end_of_text|> 1, <|eom_id|> 4, <|eot_id|> 5, "a" 70
    tok = Tokenizer(backend, chat_template=None, eos_token_ids=[5, np.int64(1), 5, 4], bos_token_id=np.int64(0))
    assert tok.eos_token_ids == (5, 1, 4) and all(type(i) is int for i in tok.eos_token_ids)
    assert tok.eos_token_id == 5 and type(tok.bos_token_id) is int and tok.bos_token_id == 0
    assert (tok.add_bos_token, tok.add_eos_token) == (False, False)
    assert (tok.bos_token, tok.eos_token) == ("<|begin_of_text|>", "<|eot_id|>")
    assert {"<|begin_of_text|>", "<|eot_id|>"} <= set(tok.special_tokens)
    bare = Tokenizer(backend, chat_template=None, eos_token_ids=())
    assert (bare.bos_token_id, bare.eos_token_id, bare.bos_token, bare.eos_token) == (None, None, None, None)
    assert Tokenizer(backend, chat_template=None, eos_token_ids=(5,), eos_token_id=np.int64(1)).eos_token_id == 1
    with pytest.raises(TokenizerMetadataError, match=_exact("add_bos_token is set but the tokenizer has no BOS token "
                                                            "id")):
        Tokenizer(backend, chat_template=None, eos_token_ids=(5,), add_bos_token=1)
    with pytest.raises(TokenizerMetadataError, match=_exact("add_eos_token is set but the tokenizer has no EOS token "
                                                            "id")):
        Tokenizer(backend, chat_template=None, eos_token_ids=(), add_eos_token=1)
    both = Tokenizer(backend, chat_template=None, eos_token_ids=(5,), bos_token_id=0, add_bos_token=1, add_eos_token=1)
    assert both.add_bos_token is True and both.add_eos_token is True
    # encode: special strings parsed by default, literal on request; BOS/EOS only when asked and not already there
    assert tok.encode("a") == [70] and both.encode("a") == [70]
    assert tok.encode("<|eot_id|>") == [5]
    literal = tok.encode("<|eot_id|>", parse_special=False)
    assert 5 not in literal and backend.decode(literal) == "<|eot_id|>"
    assert both.encode("a", add_special_tokens=True) == [0, 70, 5]
    assert both.encode("<|begin_of_text|>a<|eot_id|>", add_special_tokens=True) == [0, 70, 5]
    assert both.encode("", add_special_tokens=True) == [0, 5]
    assert both._add_special([], eos=False) == [0] and both._add_special([70], eos=False) == [0, 70]
    assert tok.encode("a", add_special_tokens=True) == [70]
    with pytest.raises(TypeError, match=_exact("text must be a str, got bytes")):
        tok.encode(b"a")
    assert tok.decode(np.array([0, 70, 5])) == "a"
    assert tok.decode([0, 70], skip_special_tokens=False) == "<|begin_of_text|>a"
    # the chat template
    with pytest.raises(ValueError, match=_exact("this model has no chat template; use the raw prompt: chat=False "
                                                "(the CLI: --no-chat)")):
        tok.apply_chat_template([{"role": "user", "content": "a"}])
    chat = Tokenizer(backend, chat_template="{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ x }}",
                     eos_token_ids=(5,), bos_token_id=0)
    assert chat.apply_chat_template(_ONE, x=3) == "<|begin_of_text|>|<|eot_id|>|True|3"
    assert chat.apply_chat_template(_ONE, False, x=3) == "<|begin_of_text|>|<|eot_id|>|False|3"


def test_tokenizer_content_helpers():
    from magicpig_jax.io.tokenizer import _map_strings, _strings

    assert _strings({"a": ["x", {"b": "y"}, ("z", 3)], "c": 3, "d": None}) == ["a", "x", "b", "y", "z", "c", "d"]
    assert _strings("s") == ["s"] and _strings(4) == []
    message = {"role": "user", "content": "ab"}
    assert _map_strings(message, str.upper) == {"ROLE": "USER", "CONTENT": "AB"} and message["content"] == "ab"
    parts = [{"type": "text", "text": "ab"}, {"type": "image"}, {"type": "text", "text": 3}, ("raw", None)]
    got = _map_strings({"role": "user", "content": parts}, str.upper)
    assert got["CONTENT"] == [{"TYPE": "TEXT", "TEXT": "AB"}, {"TYPE": "IMAGE"}, {"TYPE": "TEXT", "TEXT": 3},
                              ("RAW", None)]
    assert parts[0]["text"] == "ab"
    assert _map_strings({"role": "user", "content": None}, str.upper) == {"ROLE": "USER", "CONTENT": None}


def _hf_tok_dir(path, config=None, jinja=None, template_json=None, eos_in_post=False):
    import json
    import shutil
    from pathlib import Path

    path.mkdir()
    src = Path(__file__).parent / "fixtures" / "families" / "llama3" / "tokenizer.json"
    if eos_in_post:  # the post-processor adds <|end_of_text|> after the text too
        tj = json.loads(src.read_text())
        tj["post_processor"]["single"].append({"SpecialToken": {"id": "<|end_of_text|>", "type_id": 0}})
        tj["post_processor"]["special_tokens"]["<|end_of_text|>"] = {"id": "<|end_of_text|>", "ids": [1],
                                                                    "tokens": ["<|end_of_text|>"]}
        (path / "tokenizer.json").write_text(json.dumps(tj))
    else:
        shutil.copy(src, path / "tokenizer.json")
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    if template_json is not None:
        (path / "chat_template.json").write_text(json.dumps({"chat_template": template_json}))
    return path


def test_tokenizer_from_hf_dir_templates_special_ids_and_flags(tmp_path):
    from magicpig_jax.io.tokenizer import Tokenizer, TokenizerMetadataError

    def fields(tok):
        return (tok.chat_template, tok.bos_token_id, tok.eos_token_id, tok.eos_token_ids, tok.add_bos_token,
                tok.add_eos_token)

    d = _hf_tok_dir(tmp_path / "a", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                     "chat_template": "T1"}, jinja="J")
    tok = Tokenizer.from_hf_dir(str(d), eos_token_ids=(1, 4))
    # chat_template.jinja before tokenizer_config.json's template, as transformers 5.24 reads them
    assert fields(tok) == ("J", 0, 5, (1, 4, 5), True, False)
    d = _hf_tok_dir(tmp_path / "a2", {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                                      "chat_template": "T1"}, template_json="K")
    assert Tokenizer.from_hf_dir(str(d)).chat_template == "T1"
    assert tok.encode("a", add_special_tokens=True) == [0, 70]
    d = _hf_tok_dir(tmp_path / "b", {"bos_token": {"content": "<|begin_of_text|>"},
                                     "eos_token": {"content": "<|eot_id|>"},
                                     "chat_template": [{"name": "tool_use", "template": "T2"},
                                                       {"name": "default", "template": "T3"}],
                                     "add_bos_token": False, "add_eos_token": True})
    assert fields(Tokenizer.from_hf_dir(d)) == ("T3", 0, 5, (5,), False, True)
    # no tokenizer_config.json: the template from chat_template.jinja, BOS from the post-processor
    d = _hf_tok_dir(tmp_path / "c", None, jinja="J", template_json="K")
    assert fields(Tokenizer.from_hf_dir(d, eos_token_ids=(4,))) == ("J", 0, 4, (4,), True, False)
    d = _hf_tok_dir(tmp_path / "d", None, template_json="K")
    assert fields(Tokenizer.from_hf_dir(d)) == ("K", 0, None, (), True, False)
    # a list of templates without "default", then the .jinja file
    d = _hf_tok_dir(tmp_path / "e", {"chat_template": [{"name": "x", "template": "X"}, "junk"]}, jinja="J")
    assert fields(Tokenizer.from_hf_dir(d))[0] == "J"
    d = _hf_tok_dir(tmp_path / "f", {"chat_template": [{"name": "x", "template": "X"}]})
    assert fields(Tokenizer.from_hf_dir(d))[0] is None
    # the post-processor adds EOS too: add_eos_token and the EOS id follow it (no eos_token in the config)
    d = _hf_tok_dir(tmp_path / "g", {"bos_token": 7}, eos_in_post=True)
    assert fields(Tokenizer.from_hf_dir(d)) == (None, 0, 1, (1,), True, True)
    d = _hf_tok_dir(tmp_path / "h", {"add_eos_token": False, "add_bos_token": True, "bos_token": "<|eom_id|>"},
                    eos_in_post=True)
    assert fields(Tokenizer.from_hf_dir(d)) == (None, 4, None, (), True, False)
    d = _hf_tok_dir(tmp_path / "i", {"add_eos_token": True})
    with pytest.raises(TokenizerMetadataError, match="add_eos_token is set but the tokenizer has no EOS token id"):
        Tokenizer.from_hf_dir(d)
    with pytest.raises(FileNotFoundError, match=_exact(f"{tmp_path / 'tokenizer.json'} not found: a Hugging Face model "
                                                       "directory needs tokenizer.json")):
        Tokenizer.from_hf_dir(tmp_path)


def test_convert_gives_a_new_checkpoint_the_usual_mode_and_names_leftover_partials(tmp_path, capsys):
    """mkdtemp's directory is 0700, and renamed into place it made a new checkpoint unreadable to
    others; a conversion killed inside an empty OUT was refused as 'not empty' without saying why,
    and one killed beside a new OUT left its directory without a word."""
    import os
    from pathlib import Path

    from magicpig_jax.cli import main

    family = str(Path(__file__).parent / "fixtures" / "families" / "llama3")
    umask = os.umask(0o022)
    try:
        assert main(["convert", family, str(tmp_path / "new")]) == 0
    finally:
        os.umask(umask)
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o755
    (tmp_path / "empty" / ".empty.abc12345.partial").mkdir(parents=True)  # killed inside an existing OUT
    capsys.readouterr()
    assert main(["convert", family, str(tmp_path / "empty")]) == 2
    assert "holds .empty.abc12345.partial, from an interrupted conversion" in capsys.readouterr().err
    (tmp_path / ".beside.xyz_0123.partial").mkdir()  # killed beside a new OUT
    assert main(["convert", family, str(tmp_path / "beside")]) == 0
    assert f"{tmp_path / '.beside.xyz_0123.partial'} is from an interrupted conversion" in capsys.readouterr().err


def test_leftover_partials_match_mkdtemps_names_of_that_out_only(tmp_path):
    """The glob of OUT's name failed on 'model**v2' (convert exited 2: 'Invalid pattern'), missed the
    leftover of 'm[1]', and gave OUT 'm' the leftover of OUT 'm.v2' or 'mx' (as 'm?')."""
    import os
    import tempfile

    from magicpig_jax.io.checkpoint import leftover_partials

    for name in ("model**v2", "m[1]", "m?", "m"):
        assert leftover_partials(tmp_path / name) == []
        made = tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=tmp_path)  # as save_checkpoint names it
        assert [str(p) for p in leftover_partials(tmp_path / name)] == [made], name
        os.rmdir(made)
    for other in (".m.v2.abcdefgh.partial", ".mx.abcdefgh.partial", ".m.abc.partial", ".m.abcdefgh.partial.x"):
        (tmp_path / other).mkdir()
    assert leftover_partials(tmp_path / "m") == [] and leftover_partials(tmp_path / "m?") == []


def test_a_failed_weights_write_is_one_error_and_leaves_nothing(tmp_path, monkeypatch):
    """A full disk made orbax's save log the failure from each of its threads (hundreds of lines of
    tracebacks) and its pending writes create the partial directory's folders again after the cleanup
    (a fresh reviewer's finding, converting onto a 100 KiB tmpfs). The failure is now one OSError line,
    and the partial directory is removed until it stays gone."""
    import logging
    import threading
    import time
    from pathlib import Path

    import numpy as np
    import orbax.checkpoint as ocp

    from magicpig_jax.io import checkpoint
    from magicpig_jax.io.hf_model import read_hf_dir
    from magicpig_jax.io.tokenizer import Tokenizer

    family = Path(__file__).parent / "fixtures" / "families" / "llama3"
    config, _ = read_hf_dir(family)
    tok = Tokenizer.from_hf_dir(family)

    def failing_save(self, directory, tree, *args, **kwargs):
        logging.getLogger("absl").error("a thread's report of the failure")
        late = Path(directory).parent / "weights.orbax-checkpoint-tmp" / "ocdbt.process_0" / "d"

        def recreate():  # a write still in flight after the error
            time.sleep(0.2)
            late.mkdir(parents=True, exist_ok=True)

        threading.Thread(target=recreate).start()
        raise ValueError('RESOURCE_EXHAUSTED: Error writing "w/0.0": No space left on device\nsecond line')

    monkeypatch.setattr(ocp.StandardCheckpointer, "save", failing_save)
    with pytest.raises(OSError, match=r"^writing the checkpoint's weights failed: RESOURCE_EXHAUSTED: Error writing "
                                      r"\"w/0.0\": No space left on device$"):
        checkpoint.save_checkpoint(tmp_path / "full", config, {"w": np.ones((2, 2), np.float32)}, tok)
    time.sleep(0.3)
    assert list(tmp_path.iterdir()) == []
    assert logging.getLogger("absl").level != logging.CRITICAL  # the logger's level is given back


def test_a_checkpoint_whose_marker_is_not_a_file_is_named(tmp_path):
    """A folder whose magicpig_model.json is a directory was read as a Hugging Face folder: 'config.json not
    found: a Hugging Face model directory needs config.json' (a fresh reviewer's finding)."""
    from magicpig_jax.io.loader import load_model, read_model_config

    (tmp_path / "magicpig_model.json").mkdir()
    for read in (load_model, read_model_config):
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path / 'magicpig_model.json'} is not a file: {tmp_path} "
                                                       "is not a valid magicpig_jax checkpoint")):
            read(tmp_path)
