"""Tiny helper shared by the proof-check scripts: record failures, exit non-zero if any.

Every script accepts ``--perturb``: it then checks a deliberately wrong variant of
its statement and must fail (tests/test_proofs.py runs both modes, so a check
that cannot fail is caught); in that mode the first failure exits at once.
"""

from __future__ import annotations

import sys

PERTURB = "--perturb" in sys.argv[1:]
_failures: list[str] = []


def check(condition: bool, message: str) -> None:
    """Record ``message`` as a failure unless ``condition`` holds."""
    if not condition:
        _failures.append(message)
        print(f"FAIL: {message}")
        if PERTURB:  # the wrong statement was caught: no need to run the remaining checks
            print("perturbed statement rejected")
            sys.exit(1)


def finish(name: str) -> None:
    """Print a summary and exit 1 if any check failed, else 0."""
    if _failures:
        print(f"{name}: {len(_failures)} check(s) failed")
        sys.exit(1)
    print(f"{name}: all checks passed")
    sys.exit(0)
