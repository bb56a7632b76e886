"""A ``tokenizers`` tokenizer from GGUF ``tokenizer.*`` metadata, as llama.cpp's converter writes it.

See :mod:`magicpig_jax.io.tokenizer` for the tokenizer types, pre-tokenizers, special tokens,
stop ids and BOS/EOS conventions this follows.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

__all__ = ["TokenizerMetadataError", "PRE_TOKENIZERS", "EOG_TEXTS", "gguf_tokenizer_parts", "not_end_of_generation"]


class TokenizerMetadataError(ValueError):
    """GGUF tokenizer metadata is missing a key, malformed, or names an unsupported tokenizer (named)."""


# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Split patterns of the families' tokenizer.json files (the "original regex from tokenizer.json"
# that llama.cpp's llama-vocab.cpp quotes for each pre-tokenizer type).
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> (family, its byte-level BPE options)
PRE_TOKENIZERS: dict[str, str] = {
    "llama-bpe": "llama3", "llama3": "llama3", "llama-v3": "llama3",
    "smaug-bpe": "smaug",
    "qwen2": "qwen2", "deepseek-r1-qwen": "qwen2",
    "tekken": "tekken",
    "smollm": "smollm",
    "gpt-2": "gpt2",
}
_ADD_BOS_BY_DEFAULT = ("llama3", "tekken")  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent
# Control tokens that end generation whatever the metadata declares (llama.cpp's end-of-generation texts:
# GGUF files often declare only one of Llama 3's <|eot_id|>, <|eom_id|> and <|end_of_text|>).
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
             "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
             "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>")
# the ids that llama.cpp also ends generation at (besides EOS, EOT and EOM): fill-in-the-middle padding,
# repository and file separators
_EOG_ID_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
                "tokenizer.ggml.fim_pad_token_id", "tokenizer.ggml.fim_rep_token_id",
                "tokenizer.ggml.fim_sep_token_id")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def _byte_level_parts(family: str):
    """``(normalizer, pre_tokenizer, ignore_merges)`` of a byte-level BPE family."""
    if family == "llama3":
        return None, _split_then_bytes(_LLAMA3_PATTERN), True
    if family == "smaug":
        return None, _split_then_bytes(_LLAMA3_PATTERN), False
    if family == "qwen2":
        return normalizers.NFC(), _split_then_bytes(_QWEN2_PATTERN), False
    if family == "tekken":
        return None, _split_then_bytes(_TEKKEN_PATTERN), True
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "smollm":
        # SmolLM / StarCoder: every digit is its own piece, then GPT-2 byte-level.
        return None, pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]), False
    return None, byte_level, False


# a GGUF's named chat templates: tokenizer.chat_template.NAME (e.g. tool_use), as llama.cpp reads them
_NAMED_TEMPLATE = "tokenizer.chat_template."


# llama.cpp's texts of the fill-in-the-middle padding, repository and file-separator tokens, looked up
# when the metadata key is missing (they end generation too)
_FIM_TEXTS = {"tokenizer.ggml.fim_pad_token_id": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
              "tokenizer.ggml.fim_rep_token_id": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>",
                                                  "<reponame>"),
              "tokenizer.ggml.fim_sep_token_id": ("<|file_sep|>",)}
# ... and of the prefix, suffix and middle tokens (control tokens, not ends of generation), each with the
# legacy key llama.cpp also reads
_FIM_CONTROL_TEXTS = {
    ("tokenizer.ggml.fim_pre_token_id", "tokenizer.ggml.prefix_token_id"): (
        "<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
        "<|prefix|>"),
    ("tokenizer.ggml.fim_suf_token_id", "tokenizer.ggml.suffix_token_id"): (
        "<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
        "<|suffix|>"),
    ("tokenizer.ggml.fim_mid_token_id", "tokenizer.ggml.middle_token_id"): (
        "<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
        "<|middle|>"),
}


def _end_of_generation(meta: Mapping, tokens: list[str], types: list[int]):
    """``(eog, control, user_defined, normal)`` id sets, as llama.cpp's ``load`` derives them
    (``llama-vocab.cpp``): the end-of-generation ids (the declared EOS, EOT, EOM and FIM
    pad/rep/sep ids, the FIM tokens found by their text when undeclared, and every token whose
    text is in :data:`EOG_TEXTS`, whatever its type); the tokens it makes control tokens (those
    found by their text, the FIM prefix, suffix and middle tokens included, unused ones excepted);
    and its two exceptions: with ``<|return|>`` and
    ``<|call|>`` (or ``<|calls|>`` and ``<|flush|>``) ``<|end|>`` is no end of generation but a
    user-defined token (gpt-oss, solar-open), and with ``<|tool_response>`` ``</s>`` is a normal one
    (gemma4)."""
    eog, control = set(), set()
    for key in _EOG_ID_KEYS:
        if meta.get(key) is not None:
            eog.add(int(meta[key]))
    for key, texts in _FIM_TEXTS.items():
        if meta.get(key) is None:
            found = next((i for i, tok in enumerate(tokens) if tok in texts), None)
            if found is not None:
                eog.add(found)
                control.add(found)
    for keys, texts in _FIM_CONTROL_TEXTS.items():
        if all(meta.get(key) is None for key in keys):
            found = next((i for i, tok in enumerate(tokens) if tok in texts), None)
            if found is not None:
                control.add(found)
    for i, tok in enumerate(tokens):
        if tok in EOG_TEXTS:
            eog.add(i)
            control.add(i)
    control = {i for i in control if types[i] != _UNUSED}
    by_text = {tokens[i]: i for i in eog}
    user_defined, normal = set(), set()
    calls = "<|call|>" in by_text or "<|calls|>" in by_text
    if "<|end|>" in by_text and calls and ("<|return|>" in by_text or "<|flush|>" in by_text):
        eog.discard(by_text["<|end|>"])
        user_defined.add(by_text["<|end|>"])
    if "<|tool_response>" in by_text and "</s>" in by_text:
        eog.discard(by_text["</s>"])
        normal.add(by_text["</s>"])
    return eog, control - user_defined - normal, user_defined, normal


def not_end_of_generation(meta: Mapping, tokens: list[str], types: list[int]) -> set[int]:
    """The ids llama.cpp takes out of the end-of-generation set even where the metadata declares them
    EOS, EOT or EOM (``<|end|>`` beside ``<|return|>`` and ``<|call|>``; ``</s>`` beside
    ``<|tool_response>``: :func:`_end_of_generation`'s exceptions), so that a model's configured stop
    ids agree with its tokenizer's."""
    _, _, user_defined, normal = _end_of_generation(meta, tokens, types)
    return user_defined | normal


def _check_array(values, key: str, ok, kind: str) -> None:
    """Refuse a tokenizer array that is not a list of ``kind`` (``int()`` of a float token type 3.9 or
    ``str()`` of a number would build another tokenizer, silently), naming ``key`` and the entry."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, np.ndarray)):
        raise TokenizerMetadataError(f"{key} must be an array of {kind}, got {type(values).__name__}")
    for i, v in enumerate(values):
        if not ok(v):
            raise TokenizerMetadataError(f"{key}[{i}] = {v!r}: {key} must be an array of {kind}")


def _check_scalars(meta: Mapping) -> None:
    """Refuse a flag that is not a bool or a chat template that is not a string (``bool("false")`` is
    true), as the GGUF reader does for a file's keys, here for metadata passed directly."""
    for key in ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix"):
        if meta.get(key) is not None and not isinstance(meta[key], (bool, np.bool_)):
            raise TokenizerMetadataError(f"{key} = {meta[key]!r} must be a bool")
    for key, value in meta.items():
        if (key == "tokenizer.chat_template" or key.startswith(_NAMED_TEMPLATE)) and value is not None \
                and not isinstance(value, str):
            raise TokenizerMetadataError(f"{key} = {value!r} must be a string (a Jinja2 chat template)")


def _meta(meta: Mapping, key: str, required: bool = True):
    value = meta.get(key)
    if value is None and required:
        raise TokenizerMetadataError(f"the GGUF file has no {key!r} metadata key, which its tokenizer needs")
    return value


def _spm_merges(tokens: list[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece BPE: a pair merges into a normal piece, higher score first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    normal = [i for i, t in enumerate(types) if t == _NORMAL]
    ranked = []
    for i in normal:
        piece = tokens[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            li, ri = vocab.get(left), vocab.get(right)
            if li is not None and ri is not None and types[li] == _NORMAL and types[ri] == _NORMAL:
                ranked.append((-float(scores[i]), i, li, ri, left, right))
    ranked.sort(key=lambda r: r[:4])
    return [(r[4], r[5]) for r in ranked]


def _vocabulary(meta: Mapping) -> tuple[list[str], list[int], dict[str, int]]:
    """``(tokens, token types, vocab)`` of the GGUF vocabulary, checked."""
    tokens = _meta(meta, "tokenizer.ggml.tokens")
    _check_array(tokens, "tokenizer.ggml.tokens", lambda t: isinstance(t, str), "strings")
    tokens = list(tokens)
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        # llama.cpp's token types: 0 (undefined) and others have no meaning it applies consistently
        _check_array(types, "tokenizer.ggml.token_type",
                     lambda t: isinstance(t, (int, np.integer)) and not isinstance(t, bool) and _NORMAL <= t <= _BYTE,
                     f"integers in [{_NORMAL}, {_BYTE}] (normal, unknown, control, user-defined, unused, byte)")
    types = [int(t) for t in types] if types is not None else [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerMetadataError(
            f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        if tok in vocab:
            raise TokenizerMetadataError(
                f"duplicate token {tok!r} in tokenizer.ggml.tokens (ids {vocab[tok]}, {i})")
        vocab[tok] = i
    return tokens, types, vocab


def _byte_level_backend(meta: Mapping, pre: str, vocab: dict[str, int]) -> tuple[HFTokenizer, bool]:
    """Byte-level BPE (``tokenizer.ggml.model = gpt2``) and llama.cpp's default of ``add_bos_token``."""
    family = PRE_TOKENIZERS[pre]
    merges = []
    raw = _meta(meta, "tokenizer.ggml.merges")
    _check_array(raw, "tokenizer.ggml.merges", lambda m: isinstance(m, str), "strings ('LEFT RIGHT')")
    for i, m in enumerate(raw):
        pair = tuple(m.split(" ", 1))
        if len(pair) != 2 or pair[0] not in vocab or pair[1] not in vocab or pair[0] + pair[1] not in vocab:
            # the tokenizers library fails later with a message naming neither the key nor the entry
            raise TokenizerMetadataError(
                f"tokenizer.ggml.merges[{i}] = {m!r} is not 'LEFT RIGHT' with LEFT, RIGHT and their merge in "
                "tokenizer.ggml.tokens")
        merges.append(pair)
    normalizer, pre_tok, ignore_merges = _byte_level_parts(family)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                     ignore_merges=ignore_merges))
    if normalizer is not None:
        backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tok
    backend.decoder = decoders.ByteLevel()
    add_bos_default = family in _ADD_BOS_BY_DEFAULT
    return backend, add_bos_default


def _sentencepiece_backend(meta: Mapping, tokens: list[str], types: list[int],
                           vocab: dict[str, int]) -> HFTokenizer:
    """SentencePiece BPE (``tokenizer.ggml.model = llama``): merges from the scores, byte fallback."""
    scores = _meta(meta, "tokenizer.ggml.scores")
    _check_array(scores, "tokenizer.ggml.scores",
                 lambda v: isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)
                 and not math.isnan(v), "numbers (not NaN: the merges are ranked by them)")
    if len(scores) != len(tokens):
        raise TokenizerMetadataError(
            f"tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    if unk_id is not None and not 0 <= int(unk_id) < len(tokens):
        raise TokenizerMetadataError(
            f"tokenizer.ggml.unknown_token_id = {unk_id} is outside the vocabulary of {len(tokens)} tokens")
    if unk_id is None:
        unk_id = next((i for i, t in enumerate(types) if t == _UNKNOWN), None)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=_spm_merges(tokens, scores, types),
                                     unk_token=None if unk_id is None else tokens[int(unk_id)],
                                     fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    escape = normalizers.Replace(" ", "▁")
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), escape]) if prefix else escape
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    backend.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return backend


def _rstrip_tokens(meta: Mapping, tokens: list[str], special: set[int], user: set[int]) -> set[int]:
    """Ids of the added tokens that swallow the whitespace after them (``AddedToken(rstrip=True)``),
    of the ``special`` (control and unknown) and ``user`` (user-defined) ids as llama.cpp ends up
    classing them (a token made a control token by its text included).

    A GGUF does not record this attribute. llama.cpp (``llama_vocab::load``, "set attributes by
    model name") gives it to every control, user-defined and unknown token of a model whose
    ``general.name`` contains "phi-3" or "phi3" (case-insensitive), except ``<unk>``, ``<s>`` and
    ``<|endoftext|>``, as Phi-3's ``tokenizer.json`` marks its chat tokens:
    ``<|end|>\n`` is one token there. No other model gets it.
    """
    name = str(meta.get("general.name") or "").lower()
    if "phi-3" not in name and "phi3" not in name:
        return set()
    keep = {"<unk>", "<s>", "<|endoftext|>"}
    return {i for i in special | user if tokens[i] not in keep}


def gguf_tokenizer_parts(meta: Mapping) -> dict:
    """The :class:`~magicpig_jax.io.tokenizer.Tokenizer` arguments built from GGUF ``tokenizer.*`` fields
    (and ``general.name``, which selects llama.cpp's per-model token attributes: :func:`_rstrip_tokens`).

    Raises:
      TokenizerMetadataError (a ValueError): a needed key is missing (named, e.g.
        ``tokenizer.ggml.merges``), the tokenizer model or pre-tokenizer is not
        supported (named), or the vocabulary is malformed.
    """
    kind = _meta(meta, "tokenizer.ggml.model")
    _check_scalars(meta)
    tokens, types, vocab = _vocabulary(meta)
    # UNUSED tokens (the converter's [PADn] fillers up to the model's vocabulary size, SentencePiece's
    # unused pieces) are left out: encoding never makes them and llama.cpp decodes them to nothing,
    # as transformers does the ids its tokenizer.json lacks. One a merge needs stays.
    unused = {tokens[i] for i, t in enumerate(types) if t == _UNUSED}
    if unused and kind == "gpt2":
        for merge in meta.get("tokenizer.ggml.merges") or ():
            left, _, right = str(merge).partition(" ")
            unused -= {left, right, left + right}
    vocab = {t: i for t, i in vocab.items() if t not in unused}
    pre = meta.get("tokenizer.ggml.pre")
    if kind == "gpt2":
        if pre is None:
            raise TokenizerMetadataError(
                "the GGUF file has no 'tokenizer.ggml.pre' metadata key: its pre-tokenizer is unknown "
                "(reconvert the model with a current llama.cpp)")
        if pre == "default":
            # llama.cpp splits a byte-level vocabulary marked "default" with its own DEFAULT
            # expressions (punctuation runs, digits in threes), which are not GPT-2's
            raise TokenizerMetadataError(
                "tokenizer.ggml.pre 'default' on a byte-level BPE ('gpt2') vocabulary is not supported "
                f"(llama.cpp's DEFAULT split); supported: {', '.join(PRE_TOKENIZERS)}")
        if pre not in PRE_TOKENIZERS:
            raise TokenizerMetadataError(
                f"unsupported tokenizer.ggml.pre {pre!r}; supported: {', '.join(PRE_TOKENIZERS)}")
        backend, add_bos_default = _byte_level_backend(meta, pre, vocab)
    elif kind == "llama":
        if pre not in (None, "default"):
            raise TokenizerMetadataError(
                f"unsupported tokenizer.ggml.pre {pre!r} for a SentencePiece ('llama') tokenizer")
        backend, add_bos_default = _sentencepiece_backend(meta, tokens, types, vocab), True
    else:
        raise TokenizerMetadataError(
            f"unsupported tokenizer.ggml.model {kind!r}; supported: 'gpt2' (byte-level BPE), "
            "'llama' (SentencePiece)")
    declared = []
    for key in _EOG_ID_KEYS:
        value = meta.get(key)
        if value is not None:
            if not 0 <= int(value) < len(tokens):
                raise TokenizerMetadataError(f"{key} = {value} is outside the vocabulary of {len(tokens)} tokens")
            declared.append(int(value))
    eog, control, user_defined, normal = _end_of_generation(meta, tokens, types)
    special_ids = {i for i, t in enumerate(types)
                   if (t in (_CONTROL, _UNKNOWN) or i in control) and i not in user_defined | normal}
    user_ids = {i for i, t in enumerate(types) if (t == _USER_DEFINED and i not in control) or i in user_defined}
    rstrip = _rstrip_tokens(meta, tokens, special_ids, user_ids)
    special = [AddedToken(tokens[i], special=True, normalized=False, rstrip=i in rstrip) for i in sorted(special_ids)]
    user = [AddedToken(tokens[i], special=False, normalized=False, rstrip=i in rstrip) for i in sorted(user_ids)]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
    eos_ids = [i for i in declared if i in eog] + sorted(eog - set(declared))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is not None and not 0 <= int(bos) < len(tokens):
        raise TokenizerMetadataError(
            f"tokenizer.ggml.bos_token_id = {bos} is outside the vocabulary of {len(tokens)} tokens")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if add_bos and bos is None:
        raise TokenizerMetadataError(
            "the GGUF file sets tokenizer.ggml.add_bos_token but has no 'tokenizer.ggml.bos_token_id'")
    return dict(
        backend=backend,
        chat_template=meta.get("tokenizer.chat_template"),
        chat_templates={k[len(_NAMED_TEMPLATE):]: v for k, v in meta.items()
                        if k.startswith(_NAMED_TEMPLATE) and v is not None},
        eos_token_ids=eos_ids,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if meta.get("tokenizer.ggml.eos_token_id") is None
        else int(meta["tokenizer.ggml.eos_token_id"]),
        add_bos_token=add_bos,
        add_eos_token=add_eos,
    )
