"""Chat templates rendered as transformers' ``apply_chat_template`` renders them, in sandboxed Jinja2."""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

__all__ = ["ChatTemplateError", "render_chat_template"]


class ChatTemplateError(ValueError):
    """The chat template failed to compile or render (the message names the template error)."""


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` tag: renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


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
    try:
        return env.from_string(source)
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"the chat template does not compile: {type(err).__name__}: {err}") from err


def render_chat_template(source: str, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
                         bos_token: str | None = None, eos_token: str | None = None, **kwargs) -> str:
    """Render a chat template as transformers' ``apply_chat_template`` does.

    A sandboxed Jinja2 environment (``trim_blocks``, ``lstrip_blocks``, loop controls,
    the ``generation`` tag, transformers' ``tojson``) with the variables transformers
    passes: ``messages``, ``tools`` (None), ``documents`` (None),
    ``add_generation_prompt``, ``bos_token``/``eos_token`` (when the model has them),
    ``raise_exception`` and ``strftime_now``; ``kwargs`` are passed on (e.g.
    ``enable_thinking``).

    Raises:
      ChatTemplateError (a ValueError): the template does not compile, raises
        (``raise_exception``), or fails while rendering; the message names the error.
    """
    template = _compile_template(source)
    variables = {"tools": None, "documents": None, **kwargs}
    if bos_token is not None:
        variables.setdefault("bos_token", bos_token)
    if eos_token is not None:
        variables.setdefault("eos_token", eos_token)
    try:
        return template.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as err:
        raise ChatTemplateError(f"the chat template failed: {type(err).__name__}: {err}") from err
    except Exception as err:  # a Python error inside the template (e.g. a method of a missing value)
        raise ChatTemplateError(f"the chat template failed: {type(err).__name__}: {err}") from err
