"""The command line's argument parser: one-line errors and defaults shown once.

Every ``magicpig-jax`` subcommand builds its parser from :class:`Parser` with
:class:`DefaultsFormatter`, so bad arguments read the same everywhere (exit status 2, one
line, no usage block) and ``--help`` shows each option's default exactly once.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap

__all__ = ["DefaultsFormatter", "Parser", "plain_text"]

_ROLE = re.compile(r":[a-z]+:`(~?)([^`<]*?)(?:\s*<([^>]*)>)?`")


def plain_text(doc: str) -> str:
    """A module docstring as a terminal reads it: Sphinx roles (``:func:`~a.b.f```, ``:mod:`m```)
    become their names (``f``, ``m``); double backquotes and bold markers (``**``) are dropped."""

    def name(m: re.Match) -> str:
        tilde, target, link = m.groups()
        text = target.strip() or (link or "").strip()
        return text.rsplit(".", 1)[-1] if tilde else text

    return _ROLE.sub(name, doc).replace("``", "").replace("**", "")


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written; ``(default: X)`` appended unless the help already names the
    default, there is none to show (``None``, ``False``, suppressed) or the option is a flag
    (``--no-x`` stores False when given: "default: True" would read as the flag being on). A
    list default of a multi-value option is shown as typed, space-separated."""

    def _get_help_string(self, action):
        text = action.help or ""
        flag = isinstance(action, argparse._StoreConstAction)  # store_true / store_false / store_const
        empty = isinstance(action.default, (list, tuple)) and not action.default  # e.g. an append option
        nothing = any(action.default is x for x in (None, False, argparse.SUPPRESS))
        if flag or empty or nothing or "default" in text.lower():
            return text
        if isinstance(action.default, (list, tuple)) and action.nargs in ("+", "*"):
            # As typed: "--lengths 1024 4096", not the Python list [1024, 4096].
            shown = " ".join(map(str, action.default))
            return f"{text} (default: {shown.replace('%', '%%')})"
        return super()._get_help_string(action)

    def _split_lines(self, text, width):
        # Lines break between words only: a long default ("dense,magicpig:10x150,...") stays whole.
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_long_words=False,
                             break_on_hyphens=False)


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr (``prog: error: ...``)
    and exit status 2; ``--help`` shows the usage."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        if kwargs.get("description"):
            kwargs["description"] = plain_text(kwargs["description"])
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        # A subcommand's prog is "magicpig-jax <command>": the line starts as every other error
        # of the CLI ("magicpig-jax: error:") and names the command.
        root, *command = self.prog.split()
        where = f"{' '.join(command)}: " if command else ""
        print(f"{root}: error: {where}{message} (see --help)", file=sys.stderr)
        sys.exit(2)
