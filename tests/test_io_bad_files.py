"""Damaged, hand-edited or mistyped model files: each is refused before any decoding, naming the
file and the field, and the CLI exits 2 with one line (a break-it review's findings; each test
fails on the code before its fix: a silent load, a traceback, or an error naming neither).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from magicpig_jax.cli import main as cli_main
from magicpig_jax.io.checkpoint import MARKER
from magicpig_jax.io.loader import convert_model, load_model

FIXTURES = Path(__file__).parent / "fixtures" / "families"


def _copy(tmp_path, family="llama3") -> Path:
    folder = tmp_path / family
    shutil.copytree(FIXTURES / family, folder)
    return folder


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data), encoding="utf-8")


def _cli_error(capsys, argv) -> str:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize(("changes", "named"), [
    ({"eos_token_id": "abc"}, "'eos_token_id' must be a token id"),
    ({"eos_token_id": [1, 2.5]}, "'eos_token_id' must be a token id"),
    ({"tie_word_embeddings": "no"}, "'tie_word_embeddings' must be true or false, got 'no'"),
    ({"attention_bias": "false"}, "'attention_bias' must be true or false"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 0.0, "rope_theta": 1e4}},
     "'factor' must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 64, "rope_theta": 5e5}},
     "'high_freq_factor' (4.0) must be"),
])
def test_hf_config_values_of_the_wrong_type_or_range_are_named(tmp_path, capsys, changes, named):
    """A linear factor of 0 made every frequency infinite and loaded; "no" read as tied embeddings."""
    folder = _copy(tmp_path)
    _edit_json(folder / "config.json", **changes)
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
        load_model(folder)
    assert named in _cli_error(capsys, ["generate", "--model", str(folder), "--prompt", "hi", "--no-chat"])


@pytest.mark.parametrize("damage", ["truncated", "empty", "directory"])
def test_an_unreadable_safetensors_file_is_named(tmp_path, capsys, damage):
    folder = _copy(tmp_path)
    weights = folder / "model.safetensors"
    if damage == "truncated":  # a partial download
        weights.write_bytes(weights.read_bytes()[:1000])
    elif damage == "empty":
        weights.write_bytes(b"")
    else:
        weights.unlink()
        weights.mkdir()
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        load_model(folder)
    line = _cli_error(capsys, ["convert", str(folder), str(tmp_path / "ckpt")])
    assert "model.safetensors is not a readable safetensors file" in line


def test_convert_refuses_a_source_the_model_cannot_take_and_writes_nothing(tmp_path, capsys):
    """It wrote the checkpoint, said so, then failed on the reload naming the checkpoint, and left it."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    folder = _copy(tmp_path)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.k_proj.weight"] = np.zeros((8, 64), np.float16)  # 2 heads x 16 rows expected
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"llama3 cannot be converted \(nothing written to .*ckpt\): .*k_proj"):
        convert_model(folder, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists() and not list(tmp_path.glob(".ckpt*"))
    line = _cli_error(capsys, ["convert", str(folder), str(tmp_path / "ckpt2")])
    assert "cannot be converted" in line and not (tmp_path / "ckpt2").exists()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return convert_model(FIXTURES / "llama3", tmp_path_factory.mktemp("ckpt") / "ckpt")


@pytest.mark.parametrize(("edit", "named"), [
    (lambda m: m["config"].update(rope_scaling=[["factor", 8.0], ["high_freq_factor", 4.0], ["low_freq_factor", 1.0],
                                                ["original_max_position_embeddings", 64], ["rope_type", "dynamic"]]),
     "unsupported RoPE scaling type 'dynamic'"),
    (lambda m: m["config"]["rope_scaling"].append(["bogus", 3]), "field(s) ['bogus'] are not supported"),
    (lambda m: m["config"].update(rope_scaling={"factor": 8.0}), "'rope_scaling' must be a list of [key, value]"),
    (lambda m: m["config"].update(tie_word_embeddings="no"), "tie_word_embeddings must be true or false"),
    (lambda m: m["config"].update(eos_token_ids=["x"]), "config 'eos_token_ids' must be a list of token ids"),
    (lambda m: m.update(add_bos_token="false"), "'add_bos_token' must be true or false, got 'false'"),
    (lambda m: m.update(template_tokens={"pad": "x"}), "'template_tokens' must be an object"),
    (lambda m: m.update(weights_sha1=12), "'weights_sha1' must be a string"),
])
def test_a_hand_edited_checkpoint_is_checked_like_a_config(tmp_path, checkpoint, capsys, edit, named):
    """rope_type "dynamic" with llama3's keys computed llama3; an unknown key was ignored."""
    ckpt = tmp_path / "edited"
    shutil.copytree(checkpoint, ckpt)
    meta = json.loads((ckpt / MARKER).read_text(encoding="utf-8"))
    edit(meta)
    (ckpt / MARKER).write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(ValueError, match=r"checkpoint .*edited: .*" + named.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        load_model(ckpt)
    assert named in _cli_error(capsys, ["generate", "--model", str(ckpt), "--prompt", "hi", "--no-chat"])


def test_paths_the_os_refuses_exit_2_naming_them(tmp_path, capsys):
    long_name = str(tmp_path / ("y" * 300))  # ENAMETOOLONG: OSError from Path.exists, a traceback before
    assert "File name too long" in _cli_error(capsys, ["generate", "--model", long_name, "--prompt", "hi"])
    assert "File name too long" in _cli_error(capsys, ["convert", "embedded", long_name])
    line = _cli_error(capsys, ["generate", "--model", "/dev/null", "--prompt", "hi"])
    assert "/dev/null is not a regular file" in line
