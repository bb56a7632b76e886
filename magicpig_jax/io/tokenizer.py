"""Tokenizers built with ``tokenizers`` from GGUF metadata or a ``tokenizer.json``; chat templates with ``jinja2``.

GGUF tokenizers (``tokenizer.ggml.model``):

* ``gpt2``: byte-level BPE from ``tokenizer.ggml.tokens``/``merges``, with the pre-tokenizer
  that ``tokenizer.ggml.pre`` names, built as the family's Hugging Face ``tokenizer.json``
  builds it (see :data:`PRE_TOKENIZERS`): ``llama-bpe`` (Llama 3.x; also ``llama3``,
  ``llama-v3``), ``smaug-bpe``, ``qwen2`` (Qwen2/2.5/3, NFC-normalized; also
  ``deepseek-r1-qwen``), ``tekken`` (Mistral Nemo), ``smollm`` and ``gpt-2`` (GPT-2's
  byte-level split). Another name is an error naming it, ``default`` too (llama.cpp's own
  DEFAULT split, which is not GPT-2's).
* ``llama``: SentencePiece BPE (Llama 2, Mistral 7B, TinyLlama) from the pieces and their
  ``tokenizer.ggml.scores``: merges ranked by the score of the merged piece, byte fallback,
  spaces escaped to ``▁`` and one prefixed to every text fragment (llama.cpp's
  ``add_space_prefix``; the legacy Llama ``tokenizer.json`` does the same).

Control tokens (GGUF type 3) and the unknown token are *special*; user-defined tokens
(type 4) are added tokens that are always matched, as in ``tokenizers``.

Special tokens in user text. :meth:`Tokenizer.encode` parses special-token strings
(``"<|im_end|>"`` becomes the control token) unless ``parse_special=False``, which
encodes them as the literal characters. :meth:`Tokenizer.encode_chat`, the path for a
user's messages, encodes message contents literally by default: control tokens come
only from the template, so a message cannot close its turn or open a system turn.
``parse_special=True`` there is the opt-in for raw prompts.

Stop ids of a GGUF, as llama.cpp's: ``tokenizer.ggml.eos_token_id``, ``eot_token_id``, ``eom_token_id``,
``fim_pad_token_id``, ``fim_rep_token_id``, ``fim_sep_token_id``, and the tokens whose text
llama.cpp treats as end of generation (:data:`EOG_TEXTS`; such a token is made a control token
whatever its type, as llama.cpp does, and so are the fill-in-the-middle prefix, suffix and middle
tokens found by their text when their ids are not declared).

BOS/EOS. ``add_bos_token``/``add_eos_token`` come from the GGUF flags (defaults as
llama.cpp: true for SentencePiece, ``llama-bpe`` and ``tekken``, else false) or from
``tokenizer_config.json`` (else from what the ``tokenizer.json`` post-processor adds).
``encode(..., add_special_tokens=True)`` and :meth:`Tokenizer.encode_chat` add BOS only
when the ids do not already start with it (a template that renders ``bos_token``
gives exactly one).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from magicpig_jax.io.chat_template import ChatTemplateError, chat_inputs, render_chat_template
from magicpig_jax.io.gguf_tokenizer import EOG_TEXTS, PRE_TOKENIZERS, TokenizerMetadataError, gguf_tokenizer_parts
from magicpig_jax.io.json_files import read_json_object

__all__ = ["Tokenizer", "ChatTemplateError", "TokenizerMetadataError", "PRE_TOKENIZERS", "EOG_TEXTS",
           "TEMPLATE_TOKEN_NAMES", "render_chat_template"]

# arguments of transformers' apply_chat_template that are its own options, not template variables
_NOT_TEMPLATE_VARIABLES = frozenset({"tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
                                     "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})

# transformers' named special tokens other than BOS and EOS (its ``special_tokens_map``), which it
# passes to a chat template as variables
TEMPLATE_TOKEN_NAMES = ("unk_token", "sep_token", "pad_token", "cls_token", "mask_token")



def _refuse_unimplemented_options(cfg: Mapping, cfg_path: Path, model: Mapping) -> None:
    """Refuse tokenizer_config.json options that change what transformers encodes or decodes and
    that :class:`Tokenizer` does not implement (a silent difference in tokens or text otherwise).

    transformers (5.x, ``TokenizersBackend``): ``split_special_tokens`` sets the backend's
    ``encode_special_tokens``, so every special-token string is encoded as text, the chat
    template's too; ``clean_up_tokenization_spaces`` removes the space before punctuation and
    contractions in ``decode`` (" ." -> ".", " n't" -> "n't"), except for a BPE model (since 5.7)
    unless ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output`` is set. Our
    decode is the backend's; the supported families' tokenizers are BPE, where both agree.
    """
    if cfg.get("split_special_tokens") not in (None, False):
        raise TokenizerMetadataError(f"{cfg_path}: 'split_special_tokens' {cfg['split_special_tokens']!r} is not "
                                     "supported (special-token strings encoded as text everywhere)")
    bpe = model.get("type") == "BPE"
    forced = cfg.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output") not in (None, False)
    if cfg.get("clean_up_tokenization_spaces") not in (None, False) and (not bpe or forced):
        kind = "with clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output" if bpe else (
            f"for a {model.get('type')!r} tokenizer model")
        raise TokenizerMetadataError(f"{cfg_path}: 'clean_up_tokenization_spaces' true {kind} is not supported "
                                     "(transformers' decode then removes spaces before punctuation)")

class Tokenizer:
    """Text <-> token ids, the model's BOS/EOS conventions and its chat template.

    Built from GGUF metadata (:meth:`from_gguf_metadata`) or a Hugging Face directory
    (:meth:`from_hf_dir`); ids equal those of the Hugging Face ``tokenizers`` tokenizer of
    the same family. See the module docstring for special tokens in user text and BOS.

    Attributes:
      backend: the ``tokenizers.Tokenizer`` (never adds special tokens by itself here).
      chat_template: Jinja2 source of the default chat template, or None.
      chat_templates: the named chat templates (name -> source) of a model that has several
        (``tokenizer_config.json``'s list, a GGUF's ``tokenizer.chat_template.NAME``), e.g.
        ``tool_use``, which transformers picks when ``tools`` are given; empty otherwise.
      eos_token_ids: every id that ends generation (EOS, end of turn, end of message).
      bos_token_id: the BOS id (or None). eos_token_id: the primary EOS id (or None).
      add_bos_token, add_eos_token: whether prompts get BOS / EOS.
      template_tokens: the other named special tokens a chat template sees besides
        ``bos_token``/``eos_token`` (``unk_token``, ``sep_token``, ``pad_token``, ``cls_token``,
        ``mask_token``: transformers passes its ``special_tokens_map``); empty for GGUF files, whose
        templates llama.cpp renders with BOS and EOS only.
    """

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        chat_template: str | None,
        eos_token_ids: Sequence[int],
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        template_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, str] | None = None,
    ) -> None:
        self.backend = backend
        chat_templates = dict(chat_templates or {})
        if any(not isinstance(k, str) or not isinstance(v, str) for k, v in chat_templates.items()):
            raise TokenizerMetadataError(f"chat_templates must map template names to Jinja sources, got "
                                         f"{sorted(map(repr, chat_templates))}")
        if chat_template is None:
            chat_template = chat_templates.get("default")
        self.chat_templates = chat_templates
        template_tokens = dict(template_tokens or {})
        bad = {k: v for k, v in template_tokens.items() if k not in TEMPLATE_TOKEN_NAMES or not isinstance(v, str)}
        if bad:
            raise TokenizerMetadataError(f"template_tokens must map names among {', '.join(TEMPLATE_TOKEN_NAMES)} to "
                                         f"token texts, got {bad!r}")
        self.template_tokens = template_tokens
        self.chat_template = chat_template
        self.eos_token_ids = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self.bos_token_id = None if bos_token_id is None else int(bos_token_id)
        if eos_token_id is None and self.eos_token_ids:
            eos_token_id = self.eos_token_ids[0]
        self.eos_token_id = None if eos_token_id is None else int(eos_token_id)
        self.add_bos_token = bool(add_bos_token)
        self.add_eos_token = bool(add_eos_token)
        if self.add_bos_token and self.bos_token_id is None:
            raise TokenizerMetadataError("add_bos_token is set but the tokenizer has no BOS token id")
        if self.add_eos_token and self.eos_token_id is None:
            raise TokenizerMetadataError("add_eos_token is set but the tokenizer has no EOS token id")
        self._literal_backend: HFTokenizer | None = None

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping) -> Tokenizer:
        """Build from GGUF ``tokenizer.*`` fields (a dict of field name -> contents).

        Raises:
          TokenizerMetadataError (a ValueError): a needed key is missing (named, e.g.
            ``tokenizer.ggml.merges``), the tokenizer model or pre-tokenizer is not
            supported (named), or the vocabulary is malformed.
        """
        return cls(**gguf_tokenizer_parts(meta))

    @classmethod
    def from_hf_dir(cls, folder: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Build from a Hugging Face directory: ``tokenizer.json`` plus ``tokenizer_config.json``.

        The chat template comes from ``chat_template.jinja`` (which transformers prefers), else
        ``tokenizer_config.json`` (a string, or the ``default`` of a list of named templates, all
        of which are kept in :attr:`chat_templates`), else ``chat_template.json``; the named
        templates of ``additional_chat_templates/NAME.jinja`` join :attr:`chat_templates`.
        The named special tokens (``bos_token``, ``eos_token``, ``unk_token``, ...,
        ``additional_special_tokens``) come from ``special_tokens_map.json``, else from
        ``tokenizer_config.json`` (transformers' precedence); those and ``added_tokens_decoder``'s entries that the
        ``tokenizer.json`` does not list as added tokens are registered as transformers registers
        them (special ones are then parsed as their token, not as text). ``add_bos_token``/``add_eos_token`` come from
        ``tokenizer_config.json``, else from what the ``tokenizer.json``
        post-processor adds. Stop ids: ``eos_token_ids`` (from ``config.json`` and
        ``generation_config.json``) plus the ``eos_token`` of ``tokenizer_config.json``. Its
        ``unk_token``, ``sep_token``, ``pad_token``, ``cls_token`` and ``mask_token`` become
        :attr:`template_tokens` (chat template variables, as transformers passes them).

        Raises:
          FileNotFoundError: no ``tokenizer.json`` in ``folder``.
          TokenizerMetadataError (a ValueError): ``add_bos_token``/``add_eos_token`` that are not
            booleans, a ``chat_template.jinja`` that is not UTF-8, a malformed list of named chat
            templates, an ``added_tokens_decoder`` entry that the
            ``tokenizer.json`` vocabulary does not have at its id (named), or an option that would
            change encoding or decoding and is not implemented: ``split_special_tokens`` true
            (special-token strings encoded as text everywhere, the chat template's too), or
            ``clean_up_tokenization_spaces`` true where transformers applies it (a tokenizer whose
            model is not BPE, or with ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output``).
        """
        folder = Path(folder)
        backend = read_tokenizer_json(folder / "tokenizer.json", "a Hugging Face model directory")
        cfg_path = folder / "tokenizer_config.json"
        cfg = read_json_object(cfg_path) if cfg_path.is_file() else {}
        _refuse_unimplemented_options(cfg, cfg_path, json.loads(backend.to_str()).get("model") or {})
        template, named = cfg.get("chat_template"), {}

        def read_template(path: Path) -> str:
            try:
                return path.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise TokenizerMetadataError(f"{path} is not UTF-8 text: {err}") from None

        if (folder / "chat_template.jinja").is_file():  # transformers: the file takes priority over the config
            template = read_template(folder / "chat_template.jinja")
        elif isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            if any(not isinstance(k, str) or not isinstance(v, str) for k, v in named.items()) or len(named) != len(
                    template):
                raise TokenizerMetadataError(f"{cfg_path}: 'chat_template' must be a string or a list of "
                                             "{\"name\": ..., \"template\": ...} objects with distinct names")
            template = named.get("default")
        if template is None and (folder / "chat_template.json").is_file():
            template = read_json_object(folder / "chat_template.json").get("chat_template")
        # transformers' layout for named templates beside chat_template.jinja
        for extra in sorted((folder / "additional_chat_templates").glob("*.jinja")):
            named[extra.stem] = read_template(extra)
        if named and template is not None:  # transformers then names the default one "default"
            named.setdefault("default", template)

        specials = _special_token_entries(folder, cfg)
        _register_special_tokens(backend, specials, cfg, cfg_path)

        def token_text(key):
            tok = specials.get(key)
            if isinstance(tok, Mapping):
                tok = tok.get("content")
            return tok if isinstance(tok, str) else None

        def token_id(key):
            tok = token_text(key)
            return None if tok is None else backend.token_to_id(tok)

        for key in ("add_bos_token", "add_eos_token"):
            if cfg.get(key) is not None and not isinstance(cfg[key], bool):  # "false" would read as true
                raise TokenizerMetadataError(f"{cfg_path}: '{key}' must be true, false or null, got {cfg[key]!r}")
        # what transformers' special_tokens_map gives a chat template besides BOS and EOS
        template_tokens = {key: token_text(key) for key in TEMPLATE_TOKEN_NAMES if token_text(key) is not None}

        plain = backend.encode("a", add_special_tokens=False).ids
        full = backend.encode("a", add_special_tokens=True).ids
        start = next((k for k in range(len(full) - len(plain) + 1) if full[k:k + len(plain)] == plain), 0)
        leading, trailing = full[:start], full[start + len(plain):]
        bos_id = token_id("bos_token")
        if bos_id is None and len(leading) == 1:
            bos_id = leading[0]
        eos_id = token_id("eos_token")
        add_bos = cfg.get("add_bos_token")
        add_bos = bool(leading) if add_bos is None else bool(add_bos)
        add_eos = cfg.get("add_eos_token")
        add_eos = bool(trailing) if add_eos is None else bool(add_eos)
        if eos_id is None and add_eos and len(trailing) == 1:
            eos_id = trailing[0]
        eos_ids = list(eos_token_ids) + ([eos_id] if eos_id is not None else [])
        return cls(backend, chat_template=template, eos_token_ids=eos_ids, bos_token_id=bos_id,
                   eos_token_id=eos_id, add_bos_token=add_bos, add_eos_token=add_eos,
                   template_tokens=template_tokens, chat_templates=named)

    # -- tokens ---------------------------------------------------------------------------------

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text (or None)."""
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        """The primary EOS token's text (or None)."""
        return None if self.eos_token_id is None else self.backend.id_to_token(self.eos_token_id)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """Texts of the special (control) tokens, which ``parse_special`` decides about."""
        return tuple(t.content for t in self.backend.get_added_tokens_decoder().values() if t.special)

    def _literal(self, inner: bool = False) -> HFTokenizer:
        """The backend that encodes special-token strings as text; ``inner``: for a piece of a
        text that does not start it (a Metaspace pre-tokenizer with ``prepend_scheme`` "first"
        prefixes "▁" only at the text's start, which a piece encoded alone would get)."""
        if self._literal_backend is None:
            literal = HFTokenizer.from_str(self.backend.to_str())
            literal.encode_special_tokens = True
            self._literal_backend = literal
            spec = json.loads(self.backend.to_str())
            if _never_prepend(spec.get("pre_tokenizer")):
                inner_backend = HFTokenizer.from_str(json.dumps(spec))
                inner_backend.encode_special_tokens = True
                self._literal_inner_backend = inner_backend
            else:
                self._literal_inner_backend = literal
        return self._literal_inner_backend if inner else self._literal_backend

    def encode(self, text: str, *, parse_special: bool = True, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
          text: the text.
          parse_special: special-token strings in ``text`` (``"<|im_end|>"``) become their
            control tokens; False encodes them as literal characters. User-defined added
            tokens are matched either way.
          add_special_tokens: add BOS / EOS as :attr:`add_bos_token` / :attr:`add_eos_token`
            say, unless the ids already start with BOS / end with EOS.

        Returns:
          the ids, a list of int.

        Raises:
          TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        backend = self.backend if parse_special else self._literal()
        ids = backend.encode(text, add_special_tokens=False).ids
        return self._add_special(ids, eos=True) if add_special_tokens else ids

    def _add_special(self, ids: list[int], eos: bool) -> list[int]:
        if self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id, *ids]
        if eos and self.add_eos_token and (not ids or ids[-1] != self.eos_token_id):
            ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def partial_token(self, token_id: int) -> bool:
        """Whether a later token can still change the text of ``token_id`` at the end of a text:
        a byte-fallback token (``<0xNN>`` under a ``ByteFallback`` decoder, which decodes a run
        of them as one UTF-8 piece, U+FFFD per byte if the run is not UTF-8 as a whole), or a
        token whose own text holds U+FFFD (part of a byte-level tokenizer's multi-byte
        character), or a skipped special token (no text; it does not end a run).
        Used by :class:`~magicpig_jax.streaming.TextStream`."""
        token_id = int(token_id)
        cache = self.__dict__.setdefault("_partial", {})
        if token_id not in cache:
            if "_byte_fallback" not in self.__dict__:
                self._byte_fallback = '"ByteFallback"' in self.backend.to_str()
            if "_special_ids" not in self.__dict__:
                self._special_ids = {i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
            piece = self.backend.id_to_token(token_id)
            text = self.decode([token_id])
            # A skipped special token (or an id the vocabulary lacks) has no text and does not end a
            # run; a plain token can have none too (SentencePiece's "▁" alone, its leading space
            # stripped) and does end one.
            silent = text == "" and (piece is None or token_id in self._special_ids)
            cache[token_id] = ((self._byte_fallback and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece or "") is not None)
                               or "\ufffd" in text or silent)
        return cache[token_id]

    # -- chat -----------------------------------------------------------------------------------

    def chat_template_source(self, chat_template: str | None = None, tools=None) -> str:
        """The Jinja source that renders a conversation, chosen as transformers chooses it.

        Args:
          chat_template: None (the model's), the name of one of :attr:`chat_templates`, or a
            Jinja source of the caller's.
          tools: the conversation's tools: with tools, a model's ``tool_use`` template is
            preferred to its default.

        Raises:
          ValueError: the model has no chat template, or has only named ones and none is
            ``default`` (the names are given).
        """
        if chat_template is not None:
            if not isinstance(chat_template, str):
                raise TypeError(f"chat_template must be a template name or a Jinja source, got "
                                f"{type(chat_template).__name__}")
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if self.chat_template:
            return self.chat_template
        if self.chat_templates:
            raise ValueError(f"this model has several chat templates and none is 'default': name one with "
                             f"chat_template= (one of {', '.join(sorted(self.chat_templates))})")
        raise ValueError("this model has no chat template; use the raw prompt: chat=False (the CLI: --no-chat)")

    def apply_chat_template(self, messages: Sequence[Mapping], add_generation_prompt: bool | None = None, *,
                            chat_template: str | None = None, continue_final_message: bool | str = False,
                            **kwargs) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}]``) with the model's chat template, as text.

        Same variables and environment as transformers (:func:`render_chat_template`).
        To tokenize a conversation use :meth:`encode_chat`, which keeps message contents literal.

        Args:
          messages: the conversation.
          add_generation_prompt: end with the header of a new assistant turn; None: True,
            unless ``continue_final_message``.
          chat_template: which template (:meth:`chat_template_source`): None, a name, or a source.
          continue_final_message: end where the last message's text ends, for the model to continue
            it (transformers' option of that name; a str names the field, e.g. ``"reasoning_content"``).
          kwargs: template variables (``tools``, ``documents``, ``enable_thinking``, ...).

        Raises:
          ValueError: the model has no chat template (or no default one among several).
          TypeError: ``messages`` is not a list of dicts (named), a callable among ``tools``, or an
            option of transformers' ``apply_chat_template`` that is not a template variable
            (``tokenize``, ``return_dict``, ...; named).
          ChatTemplateError (a ValueError): the template failed (named).
        """
        misplaced = sorted(set(kwargs) & _NOT_TEMPLATE_VARIABLES)
        if misplaced:
            are = "is an option" if len(misplaced) == 1 else "are options"
            raise TypeError(f"apply_chat_template: {', '.join(map(repr, misplaced))} {are} of transformers' "
                            "apply_chat_template that this one does not take (it returns the text; encode_chat "
                            "gives the ids), not a template variable")
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        source = self.chat_template_source(chat_template, kwargs.get("tools"))
        # a caller's bos_token / eos_token (and other special tokens) override the model's, as in transformers
        kwargs = {**self.template_tokens, **kwargs}
        bos, eos = kwargs.pop("bos_token", self.bos_token), kwargs.pop("eos_token", self.eos_token)
        return render_chat_template(source, messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, bos_token=bos, eos_token=eos,
                                    **kwargs)

    def encode_chat(self, messages: Sequence[Mapping], *, add_generation_prompt: bool | None = None,
                    parse_special: bool = False, chat_template: str | None = None,
                    continue_final_message: bool | str = False, **kwargs) -> list[int]:
        """Token ids of a conversation rendered with the chat template, ready to generate from.

        Special tokens come only from the template: a special-token string inside any
        string the caller passes (a message's content, role, name or tool call, the
        ``tools``, ``documents`` or other template arguments) is encoded as the literal
        characters (``parse_special=False``, the default), so a user cannot forge a turn.
        ``parse_special=True`` is the opt-in for raw prompts (the rendered text tokenized
        as a whole, as transformers does).
        BOS is prepended when :attr:`add_bos_token` says so and the template did not
        render one; no EOS is appended (a prompt ends with the assistant's header, or with
        the last message's text under ``continue_final_message``). ``add_generation_prompt``,
        ``chat_template``, ``continue_final_message`` and ``kwargs`` are as in
        :meth:`apply_chat_template`.

        Raises:
          ValueError: the model has no chat template (or no default one among several).
          TypeError: ``messages`` is not a list of dicts (named), or as :meth:`apply_chat_template`.
          ChatTemplateError (a ValueError): the template failed (named).
        """
        options = dict(add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                       continue_final_message=continue_final_message)
        # as the template will see them: strings inside message objects are then escaped too
        messages, kwargs = chat_inputs(messages, kwargs)
        if parse_special or not self.special_tokens:
            ids = self.encode(self.apply_chat_template(messages, **options, **kwargs))
            return self._add_special(ids, eos=False)
        specials = sorted(set(self.special_tokens), key=len, reverse=True)
        pattern = re.compile("|".join(re.escape(s) for s in specials))
        # Each special string in a caller's string becomes a private-use character that nothing
        # else contains; so do the characters at a string's ends that could complete a special
        # with the caller's next string (a suffix of a special at its start, a prefix at its end):
        # "hi<|im_" + "end|>" from two content blocks must stay text. (Templates compare strings
        # such as a block's type "text": those are left as they are.)
        used = set("".join(_strings([messages, kwargs]))) | set(self.chat_template_source(chat_template,
                                                                                          kwargs.get("tools")))
        code = 0xF0000

        def fresh() -> str:
            nonlocal code
            while chr(code) in used:
                code += 1
            code += 1
            return chr(code - 1)

        marks = {s: fresh() for s in specials}
        originals = {m: s for s, m in marks.items()}
        piece_marks: dict[str, str] = {}  # a character at a string's end -> its mark

        def mark_chars(part: str) -> str:
            for ch in part:
                if ch not in piece_marks:
                    piece_marks[ch] = fresh()
            return "".join(piece_marks[ch] for ch in part)

        def edge(text: str, at_start: bool) -> int:
            """Length of the longest proper suffix (at_start) / prefix of a special that ``text``
            starts / ends with."""
            best = 0
            for s in specials:
                for k in range(min(len(s) - 1, len(text)), best, -1):
                    if (text.startswith(s[-k:]) if at_start else text.endswith(s[:k])):
                        best = k
                        break
            return best

        def escape(text: str) -> str:
            head, tail = edge(text, True), edge(text, False)
            if head + tail >= len(text):
                return mark_chars(text)
            middle = pattern.sub(lambda x: marks[x.group(0)], text[head:len(text) - tail])
            return mark_chars(text[:head]) + middle + mark_chars(text[len(text) - tail:])

        rendered = self.apply_chat_template(_map_strings(list(messages), escape), **options,
                                            **_map_strings(kwargs, escape))
        pieces = {m: ch for ch, m in piece_marks.items()}
        # the real text, and where the callers' special strings and marked characters are in it
        text_parts, user_spans, pos = [], [], 0
        for ch in rendered:
            s = originals.get(ch) or pieces.get(ch)
            if s is None:
                text_parts.append(ch)
                pos += 1
            else:
                text_parts.append(s)
                user_spans.append((pos, pos + len(s)))
                pos += len(s)
        text = "".join(text_parts)
        enc = self.backend.encode(text, add_special_tokens=False)
        special_ids = {self.backend.token_to_id(s) for s in specials}
        if not any(m in rendered for m in originals) and not any(
                tok in special_ids and any(a < ue and us < b for us, ue in user_spans)
                for tok, (a, b) in zip(enc.ids, enc.offsets, strict=True)):
            # no caller's string holds or completes a special: the text as a whole, as before
            return self._add_special(self.encode(text), eos=False)
        ids: list[int] = []
        start = 0
        for tok, (a, b) in zip(enc.ids, enc.offsets, strict=True):
            if tok in special_ids and not any(a < ue and us < b for us, ue in user_spans):
                if a > start:
                    ids += self._literal(inner=start > 0).encode(text[start:a], add_special_tokens=False).ids
                ids.append(tok)
                start = b
        if start < len(text):
            ids += self._literal(inner=start > 0).encode(text[start:], add_special_tokens=False).ids
        return self._add_special(ids, eos=False)


def _never_prepend(pre_tokenizer) -> bool:
    """Set every Metaspace ``prepend_scheme`` "first" in a ``tokenizer.json`` pre-tokenizer (nested
    in Sequences too) to "never", in place; whether there was one."""
    if not isinstance(pre_tokenizer, Mapping):
        return False
    changed = False
    if pre_tokenizer.get("type") == "Metaspace" and pre_tokenizer.get("prepend_scheme") == "first":
        pre_tokenizer["prepend_scheme"] = "never"
        changed = True
    for child in pre_tokenizer.get("pretokenizers") or ():
        changed = _never_prepend(child) or changed
    return changed


def _strings(value) -> list[str]:
    """Every string in nested mappings (keys and values), lists and tuples."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def _map_strings(value, fn):
    """A copy of ``value`` with ``fn`` applied to every string in it (mapping keys and values, list items)."""
    if isinstance(value, str):
        return fn(value)
    if isinstance(value, Mapping):
        return {_map_strings(k, fn): _map_strings(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_map_strings(v, fn) for v in value)
    return value


# transformers' named special tokens (its SPECIAL_TOKENS_ATTRIBUTES), BOS and EOS among them
_NAMED_SPECIALS = ("bos_token", "eos_token", *TEMPLATE_TOKEN_NAMES)


def _special_token_entries(folder: Path, cfg: Mapping) -> dict:
    """The named special tokens (and ``additional_special_tokens``) of a Hugging Face directory, as
    transformers reads them: ``special_tokens_map.json``'s where it gives one (it overrides
    ``tokenizer_config.json``'s, as in transformers 5.25; fine-tuned exports often disagree),
    else ``tokenizer_config.json``'s."""
    path = folder / "special_tokens_map.json"
    smap = read_json_object(path) if path.is_file() else {}
    out = {}
    for key in (*_NAMED_SPECIALS, "additional_special_tokens"):
        value = smap.get(key) if smap.get(key) is not None else cfg.get(key)
        if value is not None:
            out[key] = value
    return out


def _register_special_tokens(backend: HFTokenizer, specials: Mapping, cfg: Mapping, cfg_path: Path) -> None:
    """Add to ``backend`` the configured tokens that its ``tokenizer.json`` does not list as added
    tokens, as transformers does when it loads the directory: the named special tokens and
    ``additional_special_tokens`` (special), and ``added_tokens_decoder``'s entries (special or
    not, as they say). Only texts the vocabulary already has are registered: a token new to
    the vocabulary would have an id the model has no embedding for.

    Raises:
      TokenizerMetadataError: an ``added_tokens_decoder`` entry whose text is not the
        vocabulary's token at its id.
    """
    from tokenizers import AddedToken

    have = {t.content for t in backend.get_added_tokens_decoder().values()}
    new: dict[str, AddedToken] = {}

    def flags(entry: Mapping) -> dict:
        return {k: bool(entry[k]) for k in ("lstrip", "rstrip", "single_word", "normalized") if k in entry}

    decoder = cfg.get("added_tokens_decoder") or {}
    if not isinstance(decoder, Mapping):
        raise TokenizerMetadataError(f"{cfg_path}: 'added_tokens_decoder' must be an object")
    for key, entry in decoder.items():
        content = entry.get("content") if isinstance(entry, Mapping) else None
        if not isinstance(content, str) or content in have:
            continue
        found = backend.token_to_id(content)
        if str(found) != str(key):
            raise TokenizerMetadataError(
                f"{cfg_path}: added_tokens_decoder[{key!r}] is {content!r}, which tokenizer.json has "
                f"{'not at all' if found is None else f'at id {found}'}")
        special = bool(entry.get("special", False))
        new[content] = AddedToken(content, special=special, **{"normalized": not special, **flags(entry)})
    named = [specials.get(k) for k in _NAMED_SPECIALS] + list(specials.get("additional_special_tokens") or [])
    for entry in named:
        content = entry.get("content") if isinstance(entry, Mapping) else entry
        if not isinstance(content, str) or content in have or content in new or backend.token_to_id(content) is None:
            continue
        new[content] = AddedToken(content, special=True, **{"normalized": False,
                                                            **(flags(entry) if isinstance(entry, Mapping) else {})})
    specials_new = [t for t in new.values() if t.special]
    plain_new = [t for t in new.values() if not t.special]
    if specials_new:
        backend.add_special_tokens(specials_new)
    if plain_new:
        backend.add_tokens(plain_new)


def read_tokenizer_json(path: Path, needed_by: str) -> HFTokenizer:
    """The ``tokenizers`` tokenizer of a ``tokenizer.json`` file.

    Raises:
      FileNotFoundError: no such file (the message says that ``needed_by`` needs it).
      ValueError: the file is not a tokenizer (the message names the file and the parser's reason).
    """
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {needed_by} needs tokenizer.json")
    try:
        return HFTokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{path} is not a readable tokenizer.json ({err})") from None
