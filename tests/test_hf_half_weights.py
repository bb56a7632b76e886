"""Hugging Face float16/bfloat16 matrices are held as they are (GGUF F16/BF16 rows), not as float32 copies.

The products then run on the host matvec kernels, which are checked against gguf-py's
dequantization in ``test_host_matvec.py``; here: which form each weight is held in, and that the
logits equal those of the float32 copy (``packed_weights=False``) and of transformers.
"""

from __future__ import annotations

import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.flax import save_file
from safetensors.numpy import load_file

from magicpig_jax.generation import forward_logits
from magicpig_jax.io.loader import load_model
from tests.test_io_families import FIXTURES, TOLERANCE, _max_dlogit


def _held_forms(model) -> dict[str, str | None]:
    """The packed type of each matrix of layer 0 and of the embedding / output (None: float)."""
    m = model.module
    layer = m.layers[0]
    forms = {"qkv": layer.self_attn.qkv_qtype, "o_proj": layer.self_attn.o_proj.qtype,
             "gate_up": layer.mlp.gate_up_qtype, "down_proj": layer.mlp.down_proj.qtype, "embed": m.embed_qtype}
    if m.lm_head is not None:
        forms["lm_head"] = m.lm_head.qtype
    return forms


def _with_dtype(family: str, out, dtype) -> object:
    """A copy of the family's directory with every weight re-saved in ``dtype``."""
    folder = out / f"{family}_{jnp.dtype(dtype).name}"
    shutil.copytree(FIXTURES / family, folder)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: jnp.asarray(v, dtype) for k, v in weights.items()}, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_float16_checkpoint_is_held_as_f16_rows(family):
    ref = dict(np.load(FIXTURES / f"{family}_logits.npz"))
    model = load_model(FIXTURES / family)
    assert set(_held_forms(model).values()) == {"F16"}
    plain = load_model(FIXTURES / family, packed_weights=False)
    assert set(_held_forms(plain).values()) == {None}
    assert _max_dlogit(model, ref) <= TOLERANCE and _max_dlogit(plain, ref) <= TOLERANCE


def test_bfloat16_checkpoint_is_held_as_bf16_rows(tmp_path):
    folder = _with_dtype("mistral", tmp_path, jnp.bfloat16)
    model, plain = load_model(folder), load_model(folder, packed_weights=False)
    assert set(_held_forms(model).values()) == {"BF16"}
    ids = dict(np.load(FIXTURES / "mistral_logits.npz"))["prompt_ids"].tolist()
    a, b = forward_logits(model, ids), forward_logits(plain, ids)
    assert float(np.abs(a - b).max()) <= TOLERANCE
    # bfloat16 rounding of the weights moves the logits, so the file really was read as bfloat16
    assert float(np.abs(a - dict(np.load(FIXTURES / "mistral_logits.npz"))["logits"]).max()) > TOLERANCE


def test_float32_checkpoint_stays_float(tmp_path):
    folder = _with_dtype("qwen2", tmp_path, jnp.float32)
    model = load_model(folder)
    assert set(_held_forms(model).values()) == {None}
    assert _max_dlogit(model, dict(np.load(FIXTURES / "qwen2_logits.npz"))) <= TOLERANCE


def test_tied_output_in_bfloat16_is_dropped_only_when_equal(tmp_path):
    folder = _with_dtype("qwen2", tmp_path, jnp.bfloat16)  # tied embeddings
    weights = load_file(str(FIXTURES / "qwen2" / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    save = {k: jnp.asarray(v, jnp.bfloat16) for k, v in weights.items()}
    save_file({**save, "lm_head.weight": jnp.asarray(embed, jnp.bfloat16)}, str(folder / "model.safetensors"))
    assert load_model(folder).module.lm_head is None
    save_file({**save, "lm_head.weight": jnp.asarray(embed + 1, jnp.bfloat16)}, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="lm_head.weight differs from model.embed_tokens.weight"):
        load_model(folder)


def test_wrong_shapes_are_named_as_the_float_path_names_them(tmp_path):
    """Rows moved from k_proj to q_proj (the stacked q/k/v keeps its total), a v_proj with extra
    rows, and an unused matrix: refused with the weight's name and shape, never loaded."""
    folder = _with_dtype("mistral", tmp_path, jnp.bfloat16)
    weights = load_file(str(FIXTURES / "mistral" / "model.safetensors"))
    p = "model.layers.0."
    q, k = weights[p + "self_attn.q_proj.weight"], weights[p + "self_attn.k_proj.weight"]
    moved = {**weights, p + "self_attn.q_proj.weight": np.concatenate([q, k[:8]]),
             p + "self_attn.k_proj.weight": k[8:]}
    cases = [(moved, rf"weight '{p}self_attn.q_proj.weight' \(BF16\) has shape \({q.shape[0] + 8}, {q.shape[1]}\), "
                     rf"expected \({q.shape[0]}, {q.shape[1]}\)"),
             ({**weights, p + "self_attn.v_proj.weight": np.concatenate([weights[p + "self_attn.v_proj.weight"]] * 2)},
              rf"weight '{p}self_attn.v_proj.weight' \(BF16\) has shape"),
             ({**weights, p + "self_attn.extra.weight": q}, rf"does not use: {p}self_attn.extra.weight \(BF16\);")]
    for changed, message in cases:
        save_file({k: jnp.asarray(v, jnp.bfloat16) for k, v in changed.items()}, str(folder / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            load_model(folder)


def test_reading_through_several_mappings_gives_every_tensor(tmp_path, monkeypatch):
    """A file read through a new mapping every few bytes (as a large one is) holds the same weights."""
    from magicpig_jax.io import hf_model

    whole = hf_model.read_hf_dir(FIXTURES / "qwen3")[1]
    monkeypatch.setattr(hf_model, "_BYTES_PER_MAPPING", 1000)
    parts = hf_model.read_hf_dir(FIXTURES / "qwen3")[1]
    assert sorted(whole) == sorted(parts)
    assert all(np.array_equal(whole[k], parts[k]) for k in whole)
