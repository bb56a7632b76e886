"""Tiny random Llama-3-style, Mistral, Qwen2 and Qwen3 checkpoints against transformers' logits.

``fixtures/families/<family>/`` are Hugging Face directories written by transformers, and
``<family>_logits.npz`` transformers' float32 logits at every position of a >= 32-token prompt
(``fixtures/make_families.py``, run by hand in a torch venv). Each is loaded as the HF
directory and as a GGUF written under llama.cpp's conventions (``fixtures/gguf_convert.py``:
q/k rows permuted for ``llama``, not for ``qwen2``/``qwen3``). torch is not needed here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from magicpig_jax.generation import encode_prompt, forward_logits
from magicpig_jax.io.loader import load_model
from tests.fixtures.gguf_convert import write_gguf

FIXTURES = Path(__file__).parent / "fixtures" / "families"
# family -> tokenizer.ggml.pre (None: SentencePiece)
FAMILIES = {"llama3": "llama-bpe", "mistral": None, "qwen2": "qwen2", "qwen3": "qwen2", "smollm3": "llama-bpe",
            "phi3": None}
TOLERANCE = 1e-4


def _spm_vocab():
    return json.loads((FIXTURES / "tokenizers" / "llama_spm_vocab.json").read_text())


def gguf_of(family: str, out: Path) -> Path:
    """The family's GGUF (F16 matrices, F32 vectors), written under llama.cpp's conventions."""
    pre = FAMILIES[family]
    return write_gguf(FIXTURES / family, out / f"{family}.gguf", pre=pre,
                      spm_vocab=_spm_vocab() if pre is None else None)


def _max_dlogit(model, ref) -> float:
    logits = forward_logits(model, ref["prompt_ids"].tolist())
    assert logits.shape == ref["logits"].shape
    return float(np.abs(logits - ref["logits"]).max())


@pytest.fixture(scope="module")
def refs():
    return {f: dict(np.load(FIXTURES / f"{f}_logits.npz")) for f in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_directory_matches_transformers(family, refs):
    model = load_model(FIXTURES / family)
    ref = refs[family]
    assert len(ref["prompt_ids"]) >= 32
    diff = _max_dlogit(model, ref)
    print(f"{family} HF dir: max |dlogit| = {diff:.2e}")
    assert diff <= TOLERANCE, f"{family} HF dir: max |dlogit| = {diff:.2e}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_gguf_matches_transformers(family, refs, tmp_path):
    model = load_model(gguf_of(family, tmp_path))
    diff = _max_dlogit(model, refs[family])
    print(f"{family} GGUF: max |dlogit| = {diff:.2e}")
    assert diff <= TOLERANCE, f"{family} GGUF: max |dlogit| = {diff:.2e}"


def test_family_configs(tmp_path):
    llama3 = load_model(FIXTURES / "llama3")
    assert llama3.config.tie_word_embeddings and dict(llama3.config.rope_scaling)["rope_type"] == "llama3"
    tok = llama3.tokenizer
    ids = {t: tok.backend.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")}
    # every stop id config.json and tokenizer_config.json declare
    assert set(ids.values()) <= set(llama3.config.eos_token_ids) | set(tok.eos_token_ids)
    assert tok.add_bos_token and tok.bos_token == "<|begin_of_text|>"  # from the tokenizer.json post-processor
    mistral = load_model(FIXTURES / "mistral")
    assert mistral.config.sliding_window == 4096 and not mistral.config.tie_word_embeddings
    assert mistral.tokenizer.add_bos_token and mistral.tokenizer.bos_token == "<s>"
    qwen2 = load_model(FIXTURES / "qwen2")
    assert qwen2.config.qkv_bias and not qwen2.config.o_bias and not qwen2.config.qk_norm
    assert not qwen2.tokenizer.add_bos_token and qwen2.tokenizer.bos_token_id is None
    im_end, eot = (qwen2.tokenizer.backend.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>"))
    assert {im_end, eot} <= set(qwen2.config.eos_token_ids)  # generation_config.json's list
    qwen3 = load_model(FIXTURES / "qwen3")
    assert qwen3.config.qk_norm and qwen3.config.head_dim == 24 and not qwen3.config.qkv_bias
    # the GGUFs declare the same
    g3 = load_model(gguf_of("llama3", tmp_path))
    assert g3.tokenizer.add_bos_token and set(ids.values()) <= set(g3.tokenizer.eos_token_ids)
    gq = load_model(gguf_of("qwen3", tmp_path))
    assert gq.config.qk_norm and gq.config.head_dim == 24
    assert {im_end} <= set(gq.tokenizer.eos_token_ids)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_generate_dense_equals_magicpig(family, tmp_path):
    """Greedy decoding through every part of the decode path (biases, q/k norms, RoPE scaling, tied
    heads): dense equals the argmax of the full forward pass, and MagicPIG equals dense while the
    whole context is in its static set (a short prompt)."""
    import magicpig_jax

    for model in (load_model(FIXTURES / family), load_model(gguf_of(family, tmp_path))):
        runs = {att: magicpig_jax.generate(model, "The license of this program", attention=att, max_new_tokens=8,
                                           dense_layers=(0,), chat=False) for att in ("dense", "magicpig")}
        dense = runs["dense"].token_ids
        assert runs["magicpig"].token_ids == dense
        assert runs["magicpig"].stats["sampled_fraction"] == 0.0
        ids = encode_prompt(model, "The license of this program", chat=False)
        logits = forward_logits(model, ids + dense[:-1])
        assert np.isfinite(logits).all()
        np.testing.assert_array_equal(logits[len(ids) - 1:].argmax(-1), dense)


def test_checkpoint_keeps_the_architecture(tmp_path, refs):
    """An orbax checkpoint of a Qwen3 model (q/k norms, own head_dim) gives the same logits."""
    from magicpig_jax.io.loader import convert_model

    out = convert_model(FIXTURES / "qwen3", tmp_path / "ckpt")
    model = load_model(out)
    assert model.config.qk_norm and model.config.head_dim == 24
    assert _max_dlogit(model, refs["qwen3"]) <= TOLERANCE
    qwen2 = load_model(convert_model(gguf_of("qwen2", tmp_path), tmp_path / "ckpt2"))
    assert qwen2.config.qkv_bias and _max_dlogit(qwen2, refs["qwen2"]) <= TOLERANCE


def test_model_config_is_read_from_metadata_alone(tmp_path):
    """``read_model_config`` (what the CLI checks --dense-layers against) equals the loaded config."""
    from magicpig_jax.io.loader import convert_model, read_model_config

    gguf = gguf_of("qwen2", tmp_path)
    for path in (FIXTURES / "qwen3", gguf, convert_model(gguf, tmp_path / "ckpt")):
        assert read_model_config(path) == load_model(path).config, path
    with pytest.raises(FileNotFoundError, match="config.json not found"):
        read_model_config(tmp_path)


def test_linear_rope_scaling_matches_transformers(tmp_path):
    """The Mistral checkpoint with linear RoPE scaling in config.json (HF dir; GGUF rope.scaling.type)."""
    import shutil

    ref = dict(np.load(FIXTURES / "mistral_linear_rope_logits.npz"))
    folder = tmp_path / "mistral_linear"
    shutil.copytree(FIXTURES / "mistral", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = json.loads(str(ref["rope_parameters"]))
    (folder / "config.json").write_text(json.dumps(cfg))
    hf = load_model(folder)
    assert dict(hf.config.rope_scaling) == {"rope_type": "linear", "factor": 4.0}
    gguf_model = load_model(write_gguf(folder, tmp_path / "linear.gguf", spm_vocab=_spm_vocab()))
    assert gguf_model.config.rope_scaling == hf.config.rope_scaling
    for model in (hf, gguf_model):
        assert _max_dlogit(model, ref) <= TOLERANCE
    # and the scaling matters: the unscaled model is far from these logits
    assert _max_dlogit(load_model(FIXTURES / "mistral"), ref) > 0.01


def test_every_declared_stop_id(tmp_path):
    """GGUF eos/eot/eom ids, whatever their text, all end generation."""
    folder = FIXTURES / "qwen2"
    tok = load_model(folder).tokenizer
    ids = [tok.backend.token_to_id(t) for t in ("a", "b", "c")]
    path = write_gguf(folder, tmp_path / "stops.gguf", pre="qwen2", metadata={
        "tokenizer.ggml.eos_token_id": ids[0], "tokenizer.ggml.eot_token_id": ids[1],
        "tokenizer.ggml.eom_token_id": ids[2]})
    model = load_model(path)
    assert model.config.eos_token_ids == tuple(ids)
    assert set(ids) <= set(model.tokenizer.eos_token_ids)
    assert model.tokenizer.eos_token_id == ids[0]


DELETE = object()


def _edited_copy(family: str, tmp_path: Path, **changes) -> Path:
    """A copy of the family's HF directory with config.json fields changed (``DELETE`` removes one)."""
    import shutil

    folder = tmp_path / f"{family}_edited"
    shutil.copytree(FIXTURES / family, folder)
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is DELETE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize(("family", "changes"), [
    # transformers' Qwen2 attention has q/k/v biases and no o bias whatever 'attention_bias' says
    ("qwen2", {"attention_bias": True}),
    # a null window with use_sliding_window: transformers sets no window
    ("qwen2", {"use_sliding_window": True, "sliding_window": None, "layer_types": DELETE, "max_window_layers": 0}),
    # transformers' activation table maps 'swish' to SiLU
    ("llama3", {"hidden_act": "swish"}),
])
def test_config_variants_transformers_reads_as_the_fixture(family, changes, refs, tmp_path):
    """Config fields transformers runs with the fixture's computation: the fixture's logits."""
    model = load_model(_edited_copy(family, tmp_path, **changes))
    assert _max_dlogit(model, refs[family]) <= TOLERANCE


def test_rope_settings_read_differently_by_transformers_versions_are_refused(tmp_path):
    """A top-level rope_theta that contradicts rope_parameters (transformers 4 reads one, 5 the
    other), and a llama3 scaling without its original context (transformers 5 fills it from
    max_position_embeddings, 4 fails), load with no silent choice."""
    rope = json.loads((FIXTURES / "llama3" / "config.json").read_text())["rope_parameters"]
    with pytest.raises(ValueError, match=r"rope_theta = 100\.0.*rope_parameters\.rope_theta = 500000\.0"):
        load_model(_edited_copy("llama3", tmp_path / "a", rope_theta=100.0))
    assert load_model(_edited_copy("llama3", tmp_path / "b", rope_theta=rope["rope_theta"])).config.rope_theta == 5e5
    no_orig = {k: v for k, v in rope.items() if k != "original_max_position_embeddings"}
    with pytest.raises(ValueError, match="'original_max_position_embeddings'"):
        load_model(_edited_copy("llama3", tmp_path / "c", rope_parameters=no_orig))
    no_low = {k: v for k, v in rope.items() if k != "low_freq_factor"}
    with pytest.raises(ValueError, match="'low_freq_factor'"):
        load_model(_edited_copy("llama3", tmp_path / "d", rope_parameters=no_low))
    other = {**rope, "factor": 4.0}
    with pytest.raises(ValueError, match="'rope_scaling' and 'rope_parameters' describe different"):
        load_model(_edited_copy("llama3", tmp_path / "e", rope_scaling=other))
    # with rope_scaling present transformers reads it, not rope_parameters: a base only there is refused
    no_theta = {k: v for k, v in rope.items() if k != "rope_theta"}
    with pytest.raises(ValueError, match="only in 'rope_parameters'"):
        load_model(_edited_copy("llama3", tmp_path / "f", rope_scaling=no_theta))
    same = load_model(_edited_copy("llama3", tmp_path / "g", rope_scaling=no_theta, rope_theta=rope["rope_theta"]))
    assert same.config.rope_theta == rope["rope_theta"]


def test_sharded_directory_reads_only_the_indexed_files(refs, tmp_path):
    """Shards and their index beside a Mistral-native ``consolidated.safetensors`` (other names),
    as Mistral's repositories ship: only the files the index names are read."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "mistral_sharded"
    shutil.copytree(FIXTURES / "mistral", folder)
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(weights)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, str(folder / file))
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"tok_embeddings.weight": weights["model.embed_tokens.weight"]}, str(folder / "consolidated.safetensors"))
    assert _max_dlogit(load_model(folder), refs["mistral"]) <= TOLERANCE
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(folder)
