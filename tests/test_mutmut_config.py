"""`make mutate` runs: every test file named in ``[tool.mutmut]`` exists (a renamed test file
made pytest exit with a usage error, 4, and mutmut's stats collection fail before any mutant
ran), and every mutated glob matches a Python file."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mutmut"]


def test_every_test_file_of_the_mutmut_selection_exists():
    missing = [p for p in CONFIG["pytest_add_cli_args_test_selection"] if not (ROOT / p).is_file()]
    assert missing == []


def test_every_mutated_glob_matches_a_python_file():
    for pattern in CONFIG["only_mutate"]:
        assert any(p.suffix == ".py" for p in ROOT.glob(pattern)), pattern
