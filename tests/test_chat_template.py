"""Chat templates rendered as transformers' ``apply_chat_template`` renders them.

``fixtures/families/expected.json`` holds, for a Llama-3-style, a ChatML (Qwen) and a
Mistral-style template and several conversations, the text and ids transformers gave
(``fixtures/make_families.py``). The templates sit in the families' ``tokenizer_config.json``
and, converted, in their GGUFs' ``tokenizer.chat_template``.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from magicpig_jax.cli import main as cli_main
from magicpig_jax.io.loader import load_model
from magicpig_jax.io.tokenizer import ChatTemplateError, render_chat_template
from tests.test_io_families import gguf_of

FIXTURES = Path(__file__).parent / "fixtures" / "families"
EXPECTED = json.loads((FIXTURES / "expected.json").read_text(encoding="utf-8"))["chat"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """family -> (tokenizer of the HF directory, tokenizer of the GGUF)."""
    out = tmp_path_factory.mktemp("gguf")
    return {family: (load_model(FIXTURES / family).tokenizer, load_model(gguf_of(family, out)).tokenizer)
            for family in {case["family"] for case in EXPECTED.values()}}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_rendering_matches_transformers(name, tokenizers):
    spec = EXPECTED[name]
    for tok in tokenizers[spec["family"]]:
        assert tok.chat_template == spec["template"]
        for case in spec["cases"]:
            text = tok.apply_chat_template(case["messages"], case["add_generation_prompt"],
                                           date_string=spec["date_string"])
            assert text == case["text"], (name, case["conversation"])


@pytest.mark.parametrize("name", list(EXPECTED))
def test_ids_match_transformers(name, tokenizers):
    """transformers tokenizes the rendered text as a whole (specials parsed): our raw opt-in.

    By default the message contents are literal, which changes nothing for ordinary messages."""
    spec = EXPECTED[name]
    for tok in tokenizers[spec["family"]]:
        for case in spec["cases"]:
            kwargs = dict(add_generation_prompt=case["add_generation_prompt"], date_string=spec["date_string"])
            assert tok.encode_chat(case["messages"], parse_special=True, **kwargs) == case["ids"]
            safe = tok.encode_chat(case["messages"], **kwargs)
            if case["conversation"] == "forged":
                assert safe != case["ids"]
            else:
                assert safe == case["ids"], (name, case["conversation"])


def test_template_errors_are_named(tokenizers):
    hf, gguf_tok = tokenizers["mistral"]
    for error in EXPECTED["mistral"]["errors"]:
        for tok in (hf, gguf_tok):
            with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
                tok.apply_chat_template(error["messages"])
            assert error["error"] == "Conversation roles must alternate user/assistant/user/assistant/..."


def test_the_variables_transformers_passes():
    # bos_token / eos_token (issue 12, input 1: a template starting with {{ bos_token }})
    assert render_chat_template("{{ bos_token }}x{{ eos_token }}", [], bos_token="<s>", eos_token="</s>") == "<s>x</s>"
    assert render_chat_template("{{ bos_token }}x", []) == "x"  # a model without BOS: undefined renders empty
    assert render_chat_template("{{ strftime_now('%Y') }}", []) == str(datetime.date.today().year)
    assert render_chat_template("{{ tools is none }} {{ documents is none }} {{ add_generation_prompt }}", [],
                                add_generation_prompt=False) == "True True False"
    assert render_chat_template("{{ {'a': 'é<'} | tojson }}", []) == '{"a": "é<"}'  # no HTML escaping
    assert render_chat_template(
        "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% break %}{% endfor %}",
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a"
    assert render_chat_template("{% if enable_thinking is defined %}t{% endif %}", [], enable_thinking=False) == "t"


@pytest.mark.parametrize(("template", "named"), [
    ("{{ raise_exception('no system role') }}", "no system role"),
    ("{% if %}", "TemplateSyntaxError"),
    ("{{ undefined_function() }}", "'undefined_function' is undefined"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    ("{{ messages[0]['content'] }}", "UndefinedError"),
])
def test_failing_templates_raise_a_named_error(template, named):
    with pytest.raises(ChatTemplateError, match=named):
        render_chat_template(template, [])


def test_cli_exits_2_naming_the_template_error(tmp_path, capsys):
    path = gguf_of("qwen2", tmp_path)
    bad = tmp_path / "bad.gguf"
    from tests.fixtures.gguf_convert import write_gguf

    write_gguf(FIXTURES / "qwen2", bad, pre="qwen2",
               metadata={"tokenizer.chat_template": "{{ raise_exception('this template refuses') }}"})
    assert path.is_file()
    assert cli_main(["generate", "--model", str(bad), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    assert "this template refuses" in capsys.readouterr().err
