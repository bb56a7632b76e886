"""Helpers of the mutation tests: an error's whole message, and the library's own checks reached past
the suite's jaxtyping hook (docs/mutation.md)."""

from __future__ import annotations

import contextlib

import jaxtyping
import pytest


@contextlib.contextmanager
def without_jaxtyping():
    """The library's own argument checks, past the test suite's jaxtyping hook (which refuses the
    wrong ranks and types first). ``inspect.unwrap`` would also pass mutmut's trampoline, and so
    could not see a mutant (docs/mutation.md)."""
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", False)


def message(exc: type[BaseException], fn, *args, **kwargs) -> str:
    """The message of the ``exc`` that ``fn(*args, **kwargs)`` raises (fails the test if none)."""
    with pytest.raises(exc) as err:
        fn(*args, **kwargs)
    return str(err.value)
