"""Eval inputs refused before anything is written, and documents encoded as the model reads them."""

from __future__ import annotations

from pathlib import Path

import pytest

from magicpig_jax.cli import main as cli_main
from magicpig_jax.eval.likelihood import document_encoder, make_likelihood_sample
from magicpig_jax.eval.methods import parse_lengths
from magicpig_jax.eval.tasks import check_length_fits, make_sample
from magicpig_jax.io.tokenizer import Tokenizer

FAMILIES = Path(__file__).parent / "fixtures" / "families"


def test_likelihood_documents_start_with_the_models_bos():
    """Gemma, Mistral, Llama and Phi-3 read a text after BOS; the prose documents had none."""
    gemma = Tokenizer.from_hf_dir(FAMILIES / "gemma2")
    assert gemma.add_bos_token and gemma.bos_token_id is not None
    sample = make_likelihood_sample(document_encoder(gemma), 300, 0, forced=8)
    assert sample.ids[0] == gemma.bos_token_id and sample.ids[1:] == tuple(gemma.encode(
        gemma.decode(list(sample.ids[1:]), skip_special_tokens=False)))[:299]
    assert document_encoder(gemma)("hi") == [gemma.bos_token_id, *gemma.encode("hi")]
    qwen = Tokenizer.from_hf_dir(FAMILIES / "qwen2")  # no BOS: the ids as encoded
    assert not qwen.add_bos_token and document_encoder(qwen)("hi") == qwen.encode("hi")


def test_the_fingerprint_records_bos_documents():
    from magicpig_jax.eval.methods import parse_methods
    from magicpig_jax.eval.run import EvalSettings
    from magicpig_jax.eval.settings import FINGERPRINT_DEFAULTS
    from magicpig_jax.io.loader import load_model

    settings = EvalSettings(tasks=[], lengths=[512], samples=1, methods=parse_methods("dense"))
    assert settings.fingerprint(load_model(FAMILIES / "gemma2"))["likelihood_bos"] is True
    assert "likelihood_bos" not in settings.fingerprint(load_model(FAMILIES / "qwen2"))
    assert FINGERPRINT_DEFAULTS["likelihood_bos"] is False  # older folders: documents without BOS


def test_a_length_too_small_for_a_later_sample_is_refused_before_the_run():
    """Keys and words differ per sample: sample 0 fitting did not make the others fit, and the run
    failed at a later sample after writing records."""
    count = lambda prompt, answer: len(prompt) + len(answer)  # noqa: E731 - characters as tokens
    found = None
    for length in range(300, 2000, 5):
        try:
            check_length_fits("niah_multiquery", length, count, samples=1)
        except ValueError:
            continue
        try:
            check_length_fits("niah_multiquery", length, count, samples=10)
        except ValueError as err:
            found = length, str(err)
            break
    assert found is not None, "no length where sample 0 fits and a later one does not"
    length, message = found
    index = int(message.rsplit("(sample ", 1)[1].rstrip(")"))
    assert index > 0 and "too small for the smallest haystack" in message
    with pytest.raises(ValueError, match="too small for the smallest haystack"):  # as the run would fail
        make_sample("niah_multiquery", length, index, count)


@pytest.mark.parametrize("args, message", [
    (["--lengths", "infK"], "bad length 'infK'"),
    (["--tasks", "none", "--likelihood-samples", "0"], "nothing to do: --tasks none and --likelihood-samples 0"),
])
def test_eval_cli_refuses_in_one_line(tmp_path, capsys, args, message):
    assert cli_main(["eval", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_parse_lengths_names_an_infinite_length():
    with pytest.raises(ValueError, match="bad length 'infK'"):
        parse_lengths("2K,infK")
