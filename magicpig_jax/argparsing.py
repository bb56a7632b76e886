"""The command line's argument parser: one-line errors and defaults shown once.

Every ``magicpig-jax`` subcommand builds its parser from :class:`Parser` with
:class:`DefaultsFormatter`, so bad arguments read the same everywhere (exit status 2, one
line, no usage block) and ``--help`` shows each option's default exactly once.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["DefaultsFormatter", "Parser"]


class DefaultsFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions as written; ``(default: X)`` appended unless the help already names the
    default or there is none to show (``None``, ``False``, suppressed)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text.lower() or any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            return text
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line on stderr (``prog: error: ...``)
    and exit status 2; ``--help`` shows the usage."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        # A subcommand's prog is "magicpig-jax <command>": the line starts as every other error
        # of the CLI ("magicpig-jax: error:") and names the command.
        root, *command = self.prog.split()
        where = f"{' '.join(command)}: " if command else ""
        print(f"{root}: error: {where}{message} (see --help)", file=sys.stderr)
        sys.exit(2)
