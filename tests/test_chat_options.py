"""Chat-template choices and options as transformers has them, and special tokens configured outside
``tokenizer.json``: named templates (``tool_use`` with tools), ``chat_template=``,
``continue_final_message``, a Metaspace pre-tokenizer that prefixes only the text's start, and
special tokens named only in ``tokenizer_config.json`` / ``special_tokens_map.json``.

The ids are checked against the ``tokenizers`` library given only the template's specials as
special tokens; the texts against what transformers' ``apply_chat_template`` renders (its rules,
written out in each test).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from magicpig_jax.io.checkpoint import read_checkpoint, save_checkpoint
from magicpig_jax.io.gguf_tokenizer import gguf_tokenizer_parts
from magicpig_jax.io.tokenizer import ChatTemplateError, Tokenizer, TokenizerMetadataError
from magicpig_jax.models.config import LlamaConfig
from tests.fixtures.gguf_convert import tokenizer_metadata

FAMILIES = Path(__file__).parent / "fixtures" / "families"
USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f"}}]


def _copy(family: str, to: Path) -> Path:
    to.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FAMILIES / family / name, to / name)
    return to


def _edit_json(path: Path, fn) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    fn(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def _named(tmp_path, templates) -> Tokenizer:
    folder = _copy("qwen2", tmp_path / "named")
    _edit_json(folder / "tokenizer_config.json", lambda c: c.update(
        chat_template=[{"name": k, "template": v} for k, v in templates.items()]))
    return Tokenizer.from_hf_dir(folder)


def test_tools_pick_the_tool_use_template(tmp_path):
    tok = _named(tmp_path, {"default": "DEFAULT {{ messages[0].content }}",
                            "tool_use": "TOOL {{ tools | length }} {{ messages[0].content }}"})
    assert tok.apply_chat_template(USER) == "DEFAULT hi"
    assert tok.apply_chat_template(USER, tools=TOOLS) == "TOOL 1 hi"
    assert tok.apply_chat_template(USER, chat_template="default", tools=TOOLS) == "DEFAULT hi"
    assert tok.apply_chat_template(USER, chat_template="X{{ messages[0].content }}") == "Xhi"
    ids = tok.encode_chat(USER, tools=TOOLS)
    assert tok.decode(ids) == "TOOL 1 hi"


def test_named_templates_without_a_default(tmp_path):
    tok = _named(tmp_path, {"tool_use": "TOOL {{ messages[0].content }}", "rag": "RAG"})
    assert tok.chat_template is None and tok.apply_chat_template(USER, tools=TOOLS) == "TOOL hi"
    with pytest.raises(ValueError, match="several chat templates and none is 'default': name one with "
                                         r"chat_template= \(one of rag, tool_use\)"):
        tok.apply_chat_template(USER)
    assert tok.apply_chat_template(USER, chat_template="rag") == "RAG"


def test_named_templates_of_a_gguf_and_of_a_checkpoint(tmp_path):
    meta = tokenizer_metadata(FAMILIES / "tokenizers" / "qwen2.json", "qwen2")
    meta["tokenizer.chat_template"] = "DEFAULT"
    meta["tokenizer.chat_template.tool_use"] = "TOOL"
    tok = Tokenizer(**gguf_tokenizer_parts(meta))
    assert (tok.apply_chat_template(USER), tok.apply_chat_template(USER, tools=TOOLS)) == ("DEFAULT", "TOOL")
    config = LlamaConfig(vocab_size=tok.backend.get_vocab_size(), hidden_size=8, intermediate_size=16, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=4)
    save_checkpoint(tmp_path / "ckpt", config, {"w": __import__("numpy").zeros(2, "float32")}, tok)
    back = read_checkpoint(tmp_path / "ckpt")[2]
    assert back.chat_templates == {"tool_use": "TOOL"} and back.apply_chat_template(USER, tools=TOOLS) == "TOOL"


def test_malformed_named_templates_are_refused(tmp_path):
    folder = _copy("qwen2", tmp_path / "bad")
    _edit_json(folder / "tokenizer_config.json", lambda c: c.update(chat_template=[{"name": "default"}]))
    with pytest.raises(TokenizerMetadataError, match="'chat_template' must be a string or a list of"):
        Tokenizer.from_hf_dir(folder)


def test_continue_final_message_cuts_after_the_last_message():
    tok = Tokenizer.from_hf_dir(FAMILIES / "qwen2")
    chat = [*USER, {"role": "assistant", "content": "The answer is"}]
    full = tok.apply_chat_template(chat, add_generation_prompt=False)
    assert full.endswith("The answer is<|im_end|>\n")
    # transformers: the text up to the end of the last occurrence of the message's stripped text
    cut = tok.apply_chat_template(chat, continue_final_message=True)
    assert cut == full[:full.rindex("The answer is") + len("The answer is")]
    # trailing whitespace the template rendered is kept; one it trimmed is not asked for
    spaced = [*USER, {"role": "assistant", "content": "The answer is "}]
    assert tok.apply_chat_template(spaced, continue_final_message=True).endswith("The answer is ")
    # the ids continue the message: no end of turn, no new header
    ids = tok.encode_chat(chat, continue_final_message=True)
    assert tok.decode(ids, skip_special_tokens=False) == cut
    blocks = [*USER, {"role": "assistant", "content": [{"type": "text", "text": "Sure"}]}]
    template = "{% for m in messages %}[{{ m.content if m.content is string else m.content[0].text }}]{% endfor %}"
    assert tok.apply_chat_template(blocks, chat_template=template, continue_final_message=True) == "[hi][Sure"
    with pytest.raises(ChatTemplateError, match="continue_final_message and add_generation_prompt exclude"):
        tok.apply_chat_template(chat, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="the chat template does not read the field 'content'"):
        tok.apply_chat_template(chat, chat_template="nothing", continue_final_message=True)
    with pytest.raises(ChatTemplateError, match="does not render the last message's text"):
        tok.apply_chat_template(chat, chat_template="{{ messages[-1].content[:2] }}", continue_final_message=True)


def test_continue_final_message_cuts_at_the_message_not_at_a_later_copy_of_its_text():
    """The cut looked for the message's text and took its last occurrence: "end" was found in the
    template's <|im_end|> after it, and an empty message kept the end-of-turn token."""
    qwen = Tokenizer.from_hf_dir(FAMILIES / "qwen2")
    head = qwen.apply_chat_template([{"role": "user", "content": "Say something"}])  # ends with the assistant header
    for content in ("end", "<", "im_end"):
        chat = [{"role": "user", "content": "Say something"}, {"role": "assistant", "content": content}]
        assert qwen.apply_chat_template(chat, continue_final_message=True) == head + content
    empty = [{"role": "user", "content": "Say something"}, {"role": "assistant", "content": ""}]
    assert qwen.apply_chat_template(empty, continue_final_message=True) == head
    llama = Tokenizer.from_hf_dir(FAMILIES / "llama3")
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "eot"}]
    assert llama.apply_chat_template(chat, continue_final_message=True) == llama.apply_chat_template(
        chat[:1]) + "eot"
    # a named field: a reply's reasoning (given as "reasoning", read as "reasoning_content"), where the template
    # reads it; the qwen3 fixture's template does not, as transformers refuses too
    think = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure", "reasoning": "Let"}]
    template = "<think>{{ messages[-1].reasoning_content }}</think>{{ messages[-1].content }}"
    assert qwen.apply_chat_template(think, chat_template=template, continue_final_message="reasoning_content") == \
        "<think>Let"
    qwen3 = Tokenizer.from_hf_dir(FAMILIES / "qwen3")
    with pytest.raises(ChatTemplateError, match="does not read the field 'reasoning_content'"):
        qwen3.apply_chat_template(think, continue_final_message="reasoning_content")


def test_transformers_options_and_python_tools_are_refused():
    tok = Tokenizer.from_hf_dir(FAMILIES / "qwen2")

    def get_weather(city: str) -> str:
        """The weather."""
        return city

    with pytest.raises(TypeError, match=r"tools\[0\] is a Python callable \('get_weather'\): give its JSON schema"):
        tok.apply_chat_template(USER, tools=[get_weather])
    with pytest.raises(TypeError, match=r"tools\[1\] is a Python callable"):
        tok.encode_chat(USER, tools=[TOOLS[0], get_weather])
    with pytest.raises(TypeError, match="'return_dict', 'tokenize' are options of transformers' apply_chat_template"):
        tok.apply_chat_template(USER, tokenize=False, return_dict=True)


def test_a_metaspace_that_prefixes_the_start_only_after_a_template_special(tmp_path):
    """Mistral v0.3's layout: Metaspace with prepend_scheme "first" and no normalizer. A user's
    special string makes encode_chat encode the text in pieces; a piece after the template's BOS
    must not get the "▁" that only the text's start gets."""
    folder = _copy("mistral", tmp_path / "ms")

    def metaspace(t):
        t["normalizer"] = None
        t["pre_tokenizer"] = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": False}

    _edit_json(folder / "tokenizer.json", metaspace)
    tok = Tokenizer.from_hf_dir(folder)
    chat = [{"role": "user", "content": "Hello </s> world"}]
    rendered = tok.apply_chat_template(chat)
    assert rendered.startswith("<s>[INST]")
    # the reference: tokenizers itself, with only the template's BOS special (the user's </s> is text)
    ref_spec = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    ref_spec["added_tokens"] = [t for t in ref_spec["added_tokens"] if t["content"] != "</s>"]
    ref = HFTokenizer.from_str(json.dumps(ref_spec))
    expected = ref.encode(rendered, add_special_tokens=False).ids
    assert expected[1] != ref.token_to_id("\u2581")
    assert tok.encode_chat(chat) == expected
    # the text without the user's special goes the whole-text way: the same start
    assert tok.encode_chat([{"role": "user", "content": "Hello world"}])[:3] == expected[:3]


def test_special_tokens_named_outside_tokenizer_json(tmp_path):
    """transformers registers the configured special tokens that tokenizer.json does not list as
    added tokens (BOS/EOS of special_tokens_map.json, else tokenizer_config.json)."""
    folder = _copy("mistral", tmp_path / "noadd")
    _edit_json(folder / "tokenizer.json",
               lambda t: t.update(added_tokens=[a for a in t["added_tokens"] if a["content"] == "<unk>"]))
    _edit_json(folder / "tokenizer_config.json", lambda c: c.pop("added_tokens_decoder", None))
    tok = Tokenizer.from_hf_dir(folder)
    ref = Tokenizer.from_hf_dir(FAMILIES / "mistral")  # the same tokenizer with its added tokens listed
    assert set(tok.special_tokens) == {"<unk>", "<s>", "</s>"}
    assert tok.encode("<s>Hi</s>") == ref.encode("<s>Hi</s>") == [1, *ref.encode("Hi"), 2]
    assert tok.encode_chat(USER) == ref.encode_chat(USER)
    # only in special_tokens_map.json
    stm = _copy("mistral", tmp_path / "stm")
    config = json.loads((stm / "tokenizer_config.json").read_text(encoding="utf-8"))
    named = {k: config.pop(k) for k in ("bos_token", "eos_token") if k in config}
    config["chat_template"] = "{{ bos_token }}[{{ messages[0].content }}]{{ eos_token }}"
    (stm / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (stm / "special_tokens_map.json").write_text(json.dumps(named), encoding="utf-8")
    tok = Tokenizer.from_hf_dir(stm)
    assert tok.apply_chat_template(USER) == "<s>[hi]</s>" and 2 in tok.eos_token_ids
    # the two files disagreeing (fine-tuned exports often do): special_tokens_map.json's, as transformers 5.25
    (stm / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<unk>"}), encoding="utf-8")
    _edit_json(stm / "tokenizer_config.json", lambda c: c.update(bos_token="<s>", eos_token="</s>"))
    tok = Tokenizer.from_hf_dir(stm)
    assert tok.bos_token == "<unk>" and tok.apply_chat_template(USER) == "<unk>[hi]</s>"
    # an added_tokens_decoder entry the vocabulary has elsewhere
    _edit_json(stm / "tokenizer_config.json",
               lambda c: c.update(added_tokens_decoder={"5": {"content": "</s>", "special": True}}))
    (stm / "special_tokens_map.json").unlink()
    _edit_json(stm / "tokenizer.json",
               lambda t: t.update(added_tokens=[a for a in t["added_tokens"] if a["content"] != "</s>"]))
    with pytest.raises(TokenizerMetadataError, match=r"added_tokens_decoder\['5'\] is '</s>', which tokenizer.json "
                                                     "has at id 2"):
        Tokenizer.from_hf_dir(stm)


def test_additional_chat_templates_folder(tmp_path):
    """transformers' layout: chat_template.jinja is the default, additional_chat_templates/NAME.jinja the others."""
    folder = _copy("qwen2", tmp_path / "extra")
    (folder / "chat_template.jinja").write_text("DEFAULT", encoding="utf-8")
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "tool_use.jinja").write_text("TOOL", encoding="utf-8")
    tok = Tokenizer.from_hf_dir(folder)
    assert (tok.apply_chat_template(USER), tok.apply_chat_template(USER, tools=TOOLS)) == ("DEFAULT", "TOOL")
    assert tok.apply_chat_template(USER, chat_template="default") == "DEFAULT"  # the .jinja, named as transformers
    from magicpig_jax.io.hf_model import hf_files

    shutil.copy(FAMILIES / "qwen2" / "config.json", folder / "config.json")
    shutil.copy(FAMILIES / "qwen2" / "model.safetensors", folder / "model.safetensors")
    assert folder / "additional_chat_templates" / "tool_use.jinja" in hf_files(folder)
