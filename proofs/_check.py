"""Tiny helper shared by the proof-check scripts: record every check, exit non-zero if any fails.

Every script accepts ``--perturb``: each of its checks then tests a deliberately wrong variant
of its statement and must fail. The run does not stop at the first failure: every check runs,
and :func:`finish` requires that every ``check(...)`` call site of the script failed at least
once (so no check is vacuous, and no perturbed branch is left unexercised). Without
``--perturb``, every call site must have run and none may fail. tests/test_proofs.py runs
both modes and counts the call sites itself.

Exit codes: 0 all checks passed; 1 a check failed (without ``--perturb``), or every perturbed
check was rejected (with it); 2 a call site never ran, or a perturbed check was not rejected.
"""

from __future__ import annotations

import ast
import sys

PERTURB = "--perturb" in sys.argv[1:]
_failures: list[str] = []
_outcomes: dict[int, list[bool]] = {}  # line of the check(...) call -> its results


def check(condition: bool, message: str) -> None:
    """Record the outcome of one evaluation of the check at the caller's line."""
    line = sys._getframe(1).f_lineno
    ok = bool(condition)
    seen = _outcomes.setdefault(line, [])
    if not ok and (not PERTURB or all(seen)):  # with --perturb, only the first failure of a site
        print(f"FAIL (line {line}): {message}")
    seen.append(ok)
    if not ok:
        _failures.append(message)


def call_sites(path: str) -> list[int]:
    """Lines of the ``check(...)`` calls in the script at ``path``."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    return sorted(node.lineno for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "check")


def finish(name: str) -> None:
    """Summarize, and exit with the code described in the module docstring."""
    sites = call_sites(sys.argv[0])
    never = [s for s in sites if s not in _outcomes]
    if never:
        print(f"{name}: check(s) at line(s) {never} never ran")
        sys.exit(2)
    if PERTURB:
        kept = [s for s in sites if all(_outcomes[s])]
        if kept:
            print(f"{name}: perturbed check(s) at line(s) {kept} NOT rejected")
            sys.exit(2)
        print(f"{name}: all {len(sites)} perturbed checks rejected")
        sys.exit(1)
    if _failures:
        print(f"{name}: {len(_failures)} check(s) failed")
        sys.exit(1)
    runs = sum(len(v) for v in _outcomes.values())
    print(f"{name}: all checks passed ({runs} evaluations of {len(sites)} checks)")
    sys.exit(0)
