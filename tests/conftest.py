"""Test-suite configuration shared by every test module.

* Runtime shape/dtype checking: the jaxtyping import hook (with beartype)
  wraps every annotated function of ``magicpig_jax.attention`` and
  ``magicpig_jax.lsh``, so a call whose arrays disagree with the ``Float[Array,
  "B Hq D"]``-style annotations raises ``jaxtyping.TypeCheckError`` (a
  ``TypeError``) in tests. It must be installed before anything imports those
  modules, hence at the top of this conftest; ``test_attention.py`` asserts it
  is active.
* Strict JAX numerics for the attention/LSH tests only: the ``strict_jax``
  fixture turns on ``jax_numpy_dtype_promotion="strict"`` and
  ``jax_numpy_rank_promotion="raise"`` (as equinox's test suite does). It is
  opt-in per module (``pytestmark = pytest.mark.usefixtures("strict_jax")``) so
  that model/tokenizer/CLI tests run under JAX defaults.
* Compiled programs: after each test, JAX's caches are cleared once the process holds more
  than half of ``vm.max_map_count`` memory mappings
  (:func:`magicpig_jax.memory.release_compiled_programs`); the suite compiles enough XLA
  executables to exhaust the limit, and the compiler then crashes the process.
* XLA's persistent compilation cache in a temporary directory for the session (or the
  ``JAX_COMPILATION_CACHE_DIR`` given: ``make test`` and ``make asan`` share build/xla-cache),
  inherited by the CLI subprocesses, for every program however short its compilation (a test
  that asserts "nothing compiles" counts cache reads too).
* Hypothesis: a deterministic, database-less profile (``derandomize=True``,
  no deadline) so CI runs the same examples every time; ``make asan`` selects
  ``MAGICPIG_HYPOTHESIS_PROFILE=magicpig-sanitizer`` (10 examples per property).
* pytest-xdist (``make test`` runs two workers, a file at a time, ``--no-loadscope-reorder``): the
  workers inherit the controller's environment, so they share its compilation cache directory;
  the heaviest files are collected first (:data:`RUN_FIRST`), so that the two workers finish
  together.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# mutmut (`make mutate`) runs the tests on a mutated copy of the package in ./mutants: import
# that copy, not the editable install (whose import finder comes first on sys.meta_path), and
# load the host ops built by the install. Recognised by where this file lies (mutants/tests/),
# not by mutmut's environment: MUTMUT_DEPENDENCY_DEPTH is set only in a run that collects the
# stats, so a second `mutmut run` (stats cached) tested the editable install and every mutant
# survived (mutmut's forced-fail check caught it).
_ROOT = Path(__file__).resolve().parent.parent
if _ROOT.name == "mutants" and (_ROOT / "magicpig_jax").is_dir():
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "ScikitBuildRedirectingFinder"]
    if "MAGICPIG_HOST_OPS_LIB" not in os.environ:
        _libs = sorted(Path(sys.prefix).glob("lib/python*/site-packages/magicpig_jax/_host_ops*.so"))
        if _libs:
            os.environ["MAGICPIG_HOST_OPS_LIB"] = str(_libs[0])

# One XLA compilation cache on disk for the session and the CLI processes it starts (they inherit
# the variable): each `magicpig-jax` run on the embedded model otherwise compiles the same
# prefill and decode programs again. Deleted when the session ends.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _xla_cache = tempfile.mkdtemp(prefix="magicpig-jax-tests-xla-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    atexit.register(shutil.rmtree, _xla_cache, True)
# Every program, not only those that took a second to compile: the suite compiles the same small
# reference programs in many tests and processes, and `make asan` reads them from `make test`'s
# cache (Makefile) rather than compiling them again under the sanitizer's allocator, where XLA's
# compilation dominates the run.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# XLA's CPU code generation at LLVM's optimization level 0 (TEST_XLA_FLAG), for this process and the
# CLI processes it starts: compiling XLA programs is most of the suite's time, the suite's programs
# are small and run briefly, and the level changes how fast the generated code runs, not what it
# computes (no fast-math at any level; results may differ in the last bit where LLVM contracts a
# multiply-add). A test that runs a program long (the demo's 5,900-token prefill) starts its
# process without it (tests/_xla.py). Users' programs compile at XLA's default level.
from tests._xla import TEST_XLA_FLAG, with_test_flag  # noqa: E402

os.environ["XLA_FLAGS"] = with_test_flag(os.environ.get("XLA_FLAGS", ""))
assert TEST_XLA_FLAG in os.environ["XLA_FLAGS"]

import jaxtyping  # noqa: E402

jaxtyping.install_import_hook(["magicpig_jax.attention", "magicpig_jax.lsh"], "beartype.beartype")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "magicpig",
    derandomize=True,
    database=None,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
# `make asan`: the host ops under AddressSanitizer run each property on 10 examples (the sanitizer
# makes every example about ten times slower; `make test` has checked the values on all of them,
# the sanitizer run looks for memory errors, which the edge-case tests beside the properties target).
settings.register_profile("magicpig-sanitizer", parent=settings.get_profile("magicpig"), max_examples=10)
settings.load_profile(os.environ.get("MAGICPIG_HYPOTHESIS_PROFILE", "magicpig"))


@pytest.fixture(scope="module")
def strict_jax():
    """Strict dtype promotion and no implicit rank promotion for the whole module."""
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        yield


@pytest.fixture(autouse=True)
def _release_compiled_programs():
    """After each test: drop compiled programs if the process nears the memory-map limit."""
    yield
    from magicpig_jax.memory import release_compiled_programs

    release_compiled_programs()


# The files that take longest on the 2-core CI machine (a --durations profile of the suite), run
# first: pytest-xdist hands each worker a file when it has at most two tests left, so a long file
# handed out last keeps one worker busy after the other has finished (longest first, the rest in
# collection order). Only an order: a file not listed runs as before.
RUN_FIRST = ("test_readme.py", "test_readme_paths.py", "test_notebooks.py", "test_host_quest.py", "test_cli.py",
             "test_host_ops.py", "test_shared_projections.py", "test_attention_mutation.py",
             "test_gemma_decode.py", "test_offload.py", "test_decode_loop.py", "test_decoding.py")


def pytest_collection_modifyitems(config, items):
    """The heaviest files first (:data:`RUN_FIRST`; within a file, and for the other files, the
    collection order); under mutmut, a mutant's tests fastest first.

    mutmut runs each mutant's tests with ``-x``, so a killed mutant costs the tests up to the
    first failure: the direct float64 comparisons (a second each) then go before the decoders
    compiled end to end (ten), in the order of their durations as mutmut measured them.
    """
    rank = {name: i for i, name in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(RUN_FIRST)))  # stable: the rest keep their order
    stats = Path.cwd() / "mutmut-stats.json"
    if _ROOT.name != "mutants" or not stats.is_file() or os.environ.get("MUTANT_UNDER_TEST", "") in ("", "stats"):
        return
    import json

    duration = json.loads(stats.read_text()).get("duration_by_test", {})
    items.sort(key=lambda item: duration.get(item.nodeid, 0.0))
