"""The XLA flag the suite compiles under, and the environments of the processes it starts.

tests/conftest.py explains the choice: XLA's CPU backend at LLVM's optimization level 0, since the
suite's time is mostly compiling small programs. A process that runs a long program (a prefill of
thousands of tokens) is started with :func:`default_level` instead.
"""

from __future__ import annotations

TEST_XLA_FLAG = "--xla_backend_optimization_level=0"


def with_test_flag(flags: str = "") -> str:
    """``flags`` (an ``XLA_FLAGS`` value) with the suite's optimization level added once."""
    return flags if TEST_XLA_FLAG in flags.split() else f"{flags} {TEST_XLA_FLAG}".strip()


def default_level(env: dict[str, str]) -> dict[str, str]:
    """A copy of ``env`` whose ``XLA_FLAGS`` lacks the suite's flag (XLA's default optimization)."""
    flags = " ".join(f for f in env.get("XLA_FLAGS", "").split() if f != TEST_XLA_FLAG)
    out = {k: v for k, v in env.items() if k != "XLA_FLAGS"}
    return out | ({"XLA_FLAGS": flags} if flags else {})
