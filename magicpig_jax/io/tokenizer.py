"""Byte-level BPE tokenizer and chat template, built with ``tokenizers`` and ``jinja2``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

__all__ = ["Tokenizer"]

# GGUF token types (llama.cpp's llama_token_type): 3 = control, 4 = user-defined.
_SPECIAL_TYPES = (3, 4)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer for llama.cpp's ``tokenizer.ggml.pre`` name."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM / StarCoder: every digit is its own piece, then GPT-2 byte-level.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    if pre in ("llama3", "llama-bpe", "llama-v3", "smaug-bpe"):
        pattern = (
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+"
        )
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(
        f"unsupported tokenizer.ggml.pre {pre!r}; supported: smollm, default/gpt2, llama3/llama-bpe"
    )


class Tokenizer:
    """Text <-> token ids, plus the model's chat template.

    Built from GGUF metadata (``tokenizer.ggml.*``) or a Hugging Face
    ``tokenizer.json``; matches transformers' tokenizer for the same file
    (tested on the GPL-3 text). No BOS token is added (SmolLM2 adds none).

    Attributes:
      backend: the ``tokenizers.Tokenizer``.
      chat_template: Jinja2 source of the chat template, or None.
      eos_token_ids: ids that end generation.
      bos_token_id: the BOS id (or None).
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        chat_template: str | None,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self.bos_token_id = bos_token_id

    @classmethod
    def from_gguf_metadata(cls, meta: dict) -> Tokenizer:
        """Build from GGUF ``tokenizer.ggml.*`` fields (a dict of field name -> contents).

        Raises:
          ValueError: the tokenizer model is not byte-level BPE (``gpt2``) or the
            pre-tokenizer is unknown.
        """
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"unsupported tokenizer.ggml.model {kind!r}; only byte-level BPE 'gpt2' is supported")
        tokens = list(meta["tokenizer.ggml.tokens"])
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        backend = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        backend.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
        backend.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type")
        if types is not None:
            special = [AddedToken(tokens[i], special=True, normalized=False)
                       for i, t in enumerate(types) if t in _SPECIAL_TYPES]
            backend.add_special_tokens(special)
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = [int(eos)] if eos is not None else []
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None and int(eot) not in eos_ids:
            eos_ids.append(int(eot))
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            backend,
            chat_template=meta.get("tokenizer.chat_template"),
            eos_token_ids=eos_ids,
            bos_token_id=None if bos is None else int(bos),
        )

    @classmethod
    def from_hf_dir(cls, folder: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Build from a Hugging Face directory (``tokenizer.json``, ``tokenizer_config.json``).

        Raises:
          FileNotFoundError: no ``tokenizer.json`` in ``folder``.
        """
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a Hugging Face model directory needs tokenizer.json")
        backend = HFTokenizer.from_file(str(path))
        template = None
        eos_ids = list(eos_token_ids)
        cfg_path = folder / "tokenizer_config.json"
        if cfg_path.is_file():
            cfg = json.loads(cfg_path.read_text())
            template = cfg.get("chat_template")
            eos_tok = cfg.get("eos_token")
            if isinstance(eos_tok, dict):
                eos_tok = eos_tok.get("content")
            if isinstance(eos_tok, str) and backend.token_to_id(eos_tok) is not None:
                if backend.token_to_id(eos_tok) not in eos_ids:
                    eos_ids.append(backend.token_to_id(eos_tok))
        jinja_path = folder / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text()
        return cls(backend, chat_template=template, eos_token_ids=eos_ids)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token strings are recognized; no BOS added)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the model's chat template.

        Rendered in a sandboxed Jinja2 environment, as transformers does.

        Raises:
          ValueError: the model has no chat template.
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template; pass chat=False to use the raw prompt")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_template_error
        template = env.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt)


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)
