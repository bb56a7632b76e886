"""`make mutate` runs: every test file named in ``[tool.mutmut]`` exists (a renamed test file
made pytest exit with a usage error, 4, and mutmut's stats collection fail before any mutant
ran), and every mutated glob matches a Python file."""

from __future__ import annotations

import subprocess
import sys
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


def test_importing_the_selected_test_modules_starts_no_jax_backend():
    # forkserver_warmup = "collect": mutmut's fork server imports (collects) these modules once
    # and forks a worker per mutant from it; a backend or a jit cache made at import would be
    # shared by every worker (JAX is not fork-safe once it has run a computation)
    assert CONFIG["forkserver_warmup"] == "collect"
    modules = [Path(p).stem for p in CONFIG["pytest_add_cli_args_test_selection"]]
    code = (
        "import importlib, sys\n"
        f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'tests')!r}]\n"
        "import conftest\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "from jax._src import xla_bridge\n"
        "print(sorted(xla_bridge._backends))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
