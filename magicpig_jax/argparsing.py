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

__all__ = ["DefaultsFormatter", "Parser", "check_output", "in_flag_terms", "path_arg", "plain_text"]

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


_SEEN = "_magicpig_options_seen"  # the namespace attribute _StoreOnce records in (removed after parsing)


class _StoreOnce(argparse._StoreAction):
    """argparse's ``store``, refusing an option given twice: argparse keeps the last value silently
    (``--magicpig-config A --magicpig-config B`` ran B)."""

    def __call__(self, parser, namespace, values, option_string=None):
        if option_string is not None:
            seen = namespace.__dict__.setdefault(_SEEN, {})
            if self.dest in seen:
                parser.error(f"{'/'.join(self.option_strings)} given twice ({seen[self.dest]!r} and {values!r}): "
                             "give it once")
            seen[self.dest] = values
        super().__call__(parser, namespace, values, option_string)


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr (``prog: error: ...``)
    and exit status 2; ``--help`` shows the usage; an option that takes a value, given twice, is an
    error (argparse keeps the last one)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        if kwargs.get("description"):
            text = plain_text(kwargs["description"])
            # A one-paragraph description is wrapped to a terminal's width; a longer one is shown
            # as written (its lists and tables are laid out by hand).
            kwargs["description"] = textwrap.fill(text, 79) if "\n" not in text else text
        super().__init__(*args, **kwargs)
        self.register("action", None, _StoreOnce)
        self.register("action", "store", _StoreOnce)

    def parse_known_args(self, args=None, namespace=None):
        parsed, extra = super().parse_known_args(args, namespace)
        parsed.__dict__.pop(_SEEN, None)
        return parsed, extra

    def parse_args(self, args=None, namespace=None):
        """As argparse's, with the unrecognized arguments' error naming the flag a misspelled one
        may have meant (:func:`unrecognized_arguments`)."""
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self.error(unrecognized_arguments(self, extra))
        return parsed

    def error(self, message: str):
        # A subcommand's prog is "magicpig-jax <command>": the line starts as every other error
        # of the CLI ("magicpig-jax: error:") and names the command.
        root, *command = self.prog.split()
        where = f"{' '.join(command)}: " if command else ""
        print(f"{root}: error: {where}{message} (see --help)", file=sys.stderr)
        sys.exit(2)


def unrecognized_arguments(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """The error for arguments ``parser`` does not take, with the option a misspelled flag may
    have meant (``--promt``: ``--prompt``; difflib's closest match)."""
    import difflib

    options = [o for a in parser._actions for o in a.option_strings]
    flag = next((x.split("=", 1)[0] for x in extra if x.startswith("--")), None)
    near = difflib.get_close_matches(flag, options, n=1) if flag else []
    return f"unrecognized arguments: {' '.join(extra)}" + (f"; did you mean {near[0]}?" if near else "")


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


def check_output(flag: str, path, kind: str, inputs: dict | None = None) -> None:
    """Refuse an output the command could not write, before any work.

    Probes the file system by creating (and removing) a file where the output goes, so that
    a read-only or virtual file system is caught even for root, for whom ``os.access`` says yes.

    Args:
      flag: the option's name for messages (``"--json"``, ``"OUT"``).
      path: a ``str`` or ``Path``.
      kind: ``"file"`` (written whole), ``"prefix"`` (``PATH.json`` and ``PATH.png`` are
        written), ``"new-dir"`` (a directory created here: absent or empty, not a symbolic link) or ``"dir"``
        (a directory that may hold earlier results).
      inputs: ``{flag: path}`` of the command's input files, which the output may not replace.

    Raises:
      ValueError: the path is empty, names a directory where a file goes (or the reverse),
        ends in a separator where a prefix goes, equals an input, or cannot be written
        (the message names ``flag`` and the reason).
    """
    import os
    from pathlib import Path

    text = os.fspath(path)
    if not text.strip():
        raise ValueError(f"{flag} is empty; give a path")
    if kind == "prefix" and (text.endswith(("/", os.sep)) or Path(text).name in ("", ".", "..")):
        raise ValueError(f"{flag} {text} is a directory; give a path prefix such as {text.rstrip('/')}/bench "
                         "(PREFIX.json and PREFIX.png are written)")
    p = Path(text)
    targets = [Path(text + ".json"), Path(text + ".png")] if kind == "prefix" else [p]
    for other_flag, other in (inputs or {}).items():
        if other is not None and any(_same_file(t, Path(other)) for t in targets):
            raise ValueError(f"{flag} {text} would overwrite the {other_flag} input")
    if kind in ("file", "prefix"):
        for t in targets:
            if t.is_dir():
                raise ValueError(f"{flag} {t} is a directory; give a file path")
            if t.exists() and not os.access(t, os.W_OK):
                raise ValueError(f"{flag} {t} cannot be written (no write permission)")
        probe_dir = targets[0].parent
    else:
        if p.exists() and not p.is_dir():
            raise ValueError(f"{flag} {text} exists and is not a directory")
        if kind == "new-dir" and p.is_symlink():  # the directory is written beside it and renamed into place
            raise ValueError(f"{flag} {text} is a symbolic link; give the directory it points to, or a new path")
        if kind == "new-dir" and p.is_dir() and any(p.iterdir()):
            raise ValueError(f"{flag} {text} is a directory that is not empty; give a new or empty one")
        probe_dir = p
    existing = next((d for d in (probe_dir, *probe_dir.parents) if d.exists()), Path("."))
    if not existing.is_dir():
        raise ValueError(f"{flag} {text}: {existing} is not a directory")
    try:
        import tempfile

        fd, probe = tempfile.mkstemp(prefix=".magicpig-write-probe-", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ValueError(f"{flag} {text} cannot be written ({err.strerror or err})") from None


def model_input(model: str | None):
    """The model file or directory a ``--model`` value reads (the embedded GGUF for None or
    ``"embedded"``; None when that is not installed), for ``check_output``'s ``inputs``."""
    if model not in (None, "embedded"):
        return model
    from magicpig_jax.io.embedded import embedded_model_path

    try:
        return embedded_model_path()
    except FileNotFoundError:
        return None


def _same_file(a, b) -> bool:
    try:
        return a.exists() and b.exists() and a.samefile(b)
    except OSError:
        return False


def path_arg(text: str):
    """An argparse ``type`` for a path: refuses an empty one (``Path("")`` would silently be ``.``)."""
    from pathlib import Path

    if not text.strip():
        raise argparse.ArgumentTypeError("empty path")
    return Path(text)
