"""Chat templates rendered as transformers' ``apply_chat_template`` renders them, in sandboxed Jinja2."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

__all__ = ["ChatTemplateError", "render_chat_template", "chat_inputs"]


class ChatTemplateError(ValueError):
    """The chat template failed to compile or render (the message names the template error)."""


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` tag: renders its body as a call
    block (its own scope: a ``set`` inside does not leak out, and a loop control inside is a
    syntax error, as there)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


class _TemplateDict:
    """The template's ``dict``: builds plain dicts, exposes nothing else (transformers' sandbox)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """The template's ``namespace``, refusing attributes whose name starts with an underscore
    (transformers' sandbox: a ``SecurityError``)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja2's Namespace takes ``self`` this way too
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a chat template cannot set the underscore-prefixed namespace attribute {name!r}")


# Names a message's reasoning may come under; the first is the one templates read (transformers).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _as_dicts(value):
    """Dataclass and pydantic objects (and those inside lists, tuples and mappings) as dicts."""
    if isinstance(value, Mapping):
        return {k: _as_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_dicts(v) for v in value]
    if isinstance(value, tuple):  # a namedtuple too: a plain tuple of its fields, as transformers
        return tuple(_as_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _as_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _as_dicts(value.model_dump())
    return value


def _plain(value):
    """``value`` rebuilt from JSON types, as the template sees it (transformers' ``_plain_template_data``):
    subclasses of str/int/float and NumPy scalars become the base values, dataclasses and pydantic
    models dicts, anything else the placeholder ``"<TypeName>"``."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "dtype") and hasattr(value, "item") and getattr(value, "shape", None) == ():
        return _plain(value.item())  # a NumPy scalar: np.bool_(False) must stay false
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def chat_inputs(messages, kwargs: Mapping) -> tuple[list[dict], dict]:
    """The conversation and template arguments as transformers' ``apply_chat_template`` hands
    them to the template: message objects as dicts, the keys whose value is None dropped from
    each message (``content=None`` is a missing content, not the text "None"), everything
    rebuilt from plain JSON types (:func:`_plain`), and a message's reasoning given under
    ``reasoning`` or ``thinking`` also as ``reasoning_content`` (and as ``thinking``). Idempotent.

    Raises:
      ChatTemplateError (a ValueError): an empty conversation.
      TypeError: a message that is not a mapping (or a dataclass / pydantic object), or a Python
        callable among ``tools`` (transformers builds its JSON schema; that is not implemented).
    """
    messages = _as_dicts(list(getattr(messages, "messages", messages)))
    tools = kwargs.get("tools")
    for i, tool in enumerate(tools if isinstance(tools, (list, tuple)) else ()):
        if callable(tool) and not isinstance(tool, Mapping):
            # transformers builds a JSON schema from the function's signature and docstring
            # (get_json_schema); the plain conversion would hand the template the text "<function>"
            raise TypeError(f"tools[{i}] is a Python callable ({getattr(tool, '__name__', tool)!r}): give its JSON "
                            "schema as a dict; building one from a function is not implemented")
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation: give at least one message")
    out = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"chat messages must be dicts (or dataclass / pydantic objects), got {message!r}")
        message = _plain({k: v for k, v in message.items() if v is not None})
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out, _plain(dict(kwargs))


def _raise_template_error(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' ``tojson``: plain ``json.dumps`` (Jinja's own escapes HTML)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"the chat template does not compile: {type(err).__name__}: {err}") from err


def render_chat_template(source: str, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
                         continue_final_message: bool | str = False, bos_token: str | None = None,
                         eos_token: str | None = None, **kwargs) -> str:
    """Render a chat template as transformers' ``apply_chat_template`` does.

    A sandboxed Jinja2 environment (``trim_blocks``, ``lstrip_blocks``, loop controls,
    the ``generation`` tag, transformers' ``tojson``, ``dict`` and ``namespace``) with the
    variables transformers passes: ``messages`` and ``kwargs`` as :func:`chat_inputs` makes
    them, ``tools`` (None), ``documents`` (None), ``add_generation_prompt``,
    ``bos_token``/``eos_token`` (when the model has them), ``raise_exception`` and
    ``strftime_now``; ``kwargs`` are passed on (e.g. ``enable_thinking``).
    ``continue_final_message`` (True: the last message's ``content``; a str: that field, e.g.
    ``"reasoning_content"``): the text ends where that field's text ends (whatever the
    template renders after it, such as an end-of-turn token, is cut), so that the model
    continues it (a prefilled reply); it excludes ``add_generation_prompt``. As transformers,
    a tag is appended to the field before rendering and the text is cut where the tag lands
    (just before it; before the whitespace the template put there, if it trimmed the tag's).

    Source: transformers 5.25 ``apply_chat_template`` / ``render_jinja_template``.

    Raises:
      ChatTemplateError (a ValueError): an empty conversation; the template does not compile,
        raises (``raise_exception``), or fails while rendering; the message names the error.
        With ``continue_final_message``: ``add_generation_prompt`` set too, a last message without
        that field (or without a text block), a field the template does not read, or a template
        that does not render it.
      TypeError: a message that is not a mapping, or a callable among ``tools``.
    """
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt exclude each other: continue the "
                                "last message, or open a new assistant turn")
    template = _compile_template(source)
    messages, kwargs = chat_inputs(messages, kwargs)
    final = _tag_final_message(source, messages, continue_final_message) if continue_final_message else None
    variables = {"tools": None, "documents": None, **kwargs}
    if bos_token is not None:
        variables.setdefault("bos_token", bos_token)
    if eos_token is not None:
        variables.setdefault("eos_token", eos_token)
    try:
        text = template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"the chat template failed: {type(err).__name__}: {err}") from err
    except Exception as err:  # a Python error inside the template (e.g. a method of a missing value)
        raise ChatTemplateError(f"the chat template failed: {type(err).__name__}: {err}") from err
    if final is None:
        return text
    tag = _CONTINUE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ChatTemplateError("continue_final_message: the chat template does not render the last message's "
                                "text, so there is nothing to continue")
    at = text.rindex(tag)
    return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


# appended to the continued field before rendering; the text is cut where it lands (transformers' tag)
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(source: str, messages: list[dict], field: bool | str) -> str:
    """Append :data:`_CONTINUE_TAG` to the continued field of the last message (in place; the
    messages are :func:`chat_inputs`' copies) and return the field's text before it."""
    field = field if isinstance(field, str) else "content"
    final = messages[-1].get(field)
    if final is None:
        raise ChatTemplateError(f"continue_final_message: the last message has no {field!r} to continue")
    fields = [field]
    if field in _REASONING_FIELDS:  # reasoning is given under several names: tag each copy
        fields = [f for f in _REASONING_FIELDS if messages[-1].get(f) == final]
    if not any(f in source for f in fields):
        raise ChatTemplateError(f"continue_final_message: the chat template does not read the field {field!r}")
    if isinstance(final, (list, tuple)):  # content blocks: the last one with text
        block = next((b for b in reversed(final) if isinstance(b, dict) and "text" in b), None)
        if block is None:
            raise ChatTemplateError("continue_final_message: the last message has no text block to continue")
        text = block["text"]
        block["text"] = f"{text}{_CONTINUE_TAG}"
        return text
    if not isinstance(final, str):
        raise ChatTemplateError(f"continue_final_message: the last message's {field!r} is not text")
    for f in fields:
        messages[-1][f] = f"{final}{_CONTINUE_TAG}"
    return final
