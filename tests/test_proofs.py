"""Every proof check in proofs/ fails on its deliberately wrong variant; that each passes is checked by
tests/test_pure_import.py, which runs them all in one process without the compiled extension."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PROOFS = Path(__file__).resolve().parent.parent / "proofs"
SCRIPTS = sorted(p for p in PROOFS.glob("*.py") if not p.name.startswith("_"))
TIMEOUT_S = 120  # each script is designed for < 20 s on a 2-core machine


def _run(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(script), *args], cwd=PROOFS, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def test_every_proof_has_a_check_and_vice_versa():
    docs = {p.stem for p in PROOFS.glob("*.md") if p.name != "README.md"}
    checks = {p.stem for p in SCRIPTS}
    assert docs == checks
    assert len(docs) >= 7
    readme = (PROOFS / "README.md").read_text()
    for stem in docs:
        assert f"({stem}.md)" in readme and f"({stem}.py)" in readme, stem


def check_sites(script: Path) -> int:
    """The number of ``check(...)`` calls in a script (counted here, not by the script)."""
    tree = ast.parse(script.read_text())
    return sum(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "check"
               for n in ast.walk(tree))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_proof_check_fails_on_a_wrong_statement(script):
    # Every check of the script runs perturbed (no exit at the first failure), and each fails.
    n = check_sites(script)
    assert n >= 5
    result = _run(script, "--perturb")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"all {n} perturbed checks rejected" in result.stdout
    assert result.stdout.count("FAIL (line ") == n
