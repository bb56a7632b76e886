"""The command line's argument parser: one-line errors and defaults shown once.

Every ``magicpig-jax`` subcommand builds its parser from :class:`Parser` with
:class:`DefaultsFormatter`, so bad arguments read the same everywhere (exit status 2, one
line, no usage block) and ``--help`` shows each option's default exactly once.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import textwrap
from collections.abc import Iterator

__all__ = ["DefaultsFormatter", "Parser", "in_flag_terms", "plain_text"]

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
        # Lines break between words, never inside a name; a comma-separated list longer than the
        # line ("dense,magicpig:10x150,...") breaks after a comma.
        lines = []
        for line in textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_long_words=False,
                                  break_on_hyphens=False):
            while len(line) > width and "," in line[:width]:
                cut = line.rindex(",", 0, width) + 1
                lines.append(line[:cut])
                line = line[cut:]
            lines.append(line)
        return lines


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr (``prog: error: ...``)
    and exit status 2; ``--help`` shows the usage."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        if kwargs.get("description"):
            text = plain_text(kwargs["description"])
            # A one-paragraph description is wrapped to a terminal's width; a longer one is shown
            # as written (its lists and tables are laid out by hand).
            kwargs["description"] = textwrap.fill(text, 79) if "\n" not in text else text
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        # A subcommand's prog is "magicpig-jax <command>": the line starts as every other error
        # of the CLI ("magicpig-jax: error:") and names the command.
        root, *command = self.prog.split()
        where = f"{' '.join(command)}: " if command else ""
        print(f"{root}: error: {where}{message} (see --help)", file=sys.stderr)
        sys.exit(2)


@contextlib.contextmanager
def in_flag_terms(**flags: str) -> Iterator[None]:
    """Re-raise a library error about one of the fields ``flags`` names in the command line's terms.

    The library's checks name their field (``"top_p must be in (0, 1], got top_p=1.5"``); a user
    typed ``--top-p 1.5`` and reads ``"--top-p must be in (0, 1], got 1.5"``. Give each field with
    its flag: ``with in_flag_terms(top_p="--top-p"): Sampling(top_p=args.top_p)``. Errors about
    other fields, and other exceptions, pass unchanged.

    Raises:
      ValueError, TypeError: the library's, reworded when it names one of ``flags``.
    """
    try:
        yield
    except (ValueError, TypeError) as err:
        msg = str(err)
        for field, flag in flags.items():
            if msg.startswith(field + " must "):
                raise type(err)(flag + msg[len(field):].replace(f"got {field}=", "got ")) from None
        raise
