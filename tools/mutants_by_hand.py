"""Run chosen tests against mutmut's mutants one by one, in one process (outside the test suite).

mutmut's own run collects statistics over the whole test selection first and reruns every test
of a function for each surviving mutant, which on the 2-core machine takes hours per module. This
runs the given pytest arguments (usually one fast test file) against each named mutant instead,
with ``MUTANT_UNDER_TEST`` set (mutmut's trampolines read it on every call) and JAX's caches
cleared between mutants, stopping at the first failure. The unmutated code must pass first.

Usage, from mutmut's ``mutants/`` directory of a copy (``make mutate`` or docs/mutation.md)::

    python ../../../tools/mutants_by_hand.py NAMES.txt OUT.jsonl -- tests/test_x_mutation.py

``NAMES.txt`` holds one mutant name per line (``magicpig_jax.host.validate.x_check_int__mutmut_3``);
``OUT.jsonl`` gets one record per mutant (name, ``killed``/``survived``/``rcN``, the first failing
test, seconds) and is resumed when it exists. Caveats (docs/mutation.md): the figures count only the
tests given, so they are lower bounds; a function that caches state for the life of the process
(``host._ext.ops``) runs its mutants only in a fresh process, so rerun the survivors one process
each (``MUTANT_UNDER_TEST=NAME python -m pytest -x ...``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time


class _Failures:
    """A pytest plugin recording the ids of the tests that fail."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.failed:
            self.failed.append(report.nodeid)


def _run(name: str, args: list[str]) -> tuple[int, list[str], float]:
    import jax
    import pytest

    os.environ["MUTANT_UNDER_TEST"] = name
    jax.clear_caches()
    rec = _Failures()
    t = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = pytest.main(["-x", "-q", "-p", "no:cacheprovider", "--no-header", *args], plugins=[rec])
    return int(rc), rec.failed, time.perf_counter() - t


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 2:
        print(__doc__, file=sys.stderr)
        return 2
    names_file, out_file, args = argv[0], argv[1], argv[3:]
    sys.path.insert(0, os.getcwd())  # the mutated copy first, before any installed package
    names = [line.strip() for line in open(names_file) if line.strip()]
    done = set()
    if os.path.exists(out_file):
        done = {json.loads(line)["name"] for line in open(out_file)}
    rc, failed, _ = _run("", args)
    if rc != 0:
        print(f"the unmutated code fails {failed[:3]} (pytest exit {rc})", file=sys.stderr)
        return 1
    import magicpig_jax

    if not magicpig_jax.__file__.startswith(os.getcwd()):
        print(f"magicpig_jax imported from {magicpig_jax.__file__}, not this copy", file=sys.stderr)
        return 1
    with open(out_file, "a") as out:
        for name in names:
            if name in done:
                continue
            rc, failed, seconds = _run(name, args)
            status = {0: "survived", 1: "killed"}.get(rc, f"rc{rc}")
            out.write(json.dumps({"name": name, "status": status, "by": failed[:1], "s": round(seconds, 1)}) + "\n")
            out.flush()
            print(name.rsplit(".", 1)[-1], status, failed[:1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
