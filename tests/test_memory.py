"""magicpig_jax.memory: the peak RSS figure, freed large buffers and compiled programs going back to the OS."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magicpig_jax.memory import (
    current_rss_bytes,
    drop_compiled_programs,
    peak_rss_bytes,
    release_compiled_programs,
    release_freed_buffers,
    trim_heap,
)


def test_peak_is_at_least_the_current_rss():
    now = current_rss_bytes()
    assert now > 0 and peak_rss_bytes() >= now - (4 << 20)  # the kernel syncs per-thread counters lazily


_FREED_BUFFERS = """
import sys
import numpy as np
from magicpig_jax.memory import current_rss_bytes, release_freed_buffers
if sys.argv[1] == "release":
    assert release_freed_buffers() and release_freed_buffers()  # idempotent
x = np.ones(16 << 20, np.uint8)
del x  # glibc's default: freeing a mapped 16 MiB buffer raises its mmap threshold to 16 MiB
base = current_rss_bytes()
bufs = [np.ones(8 << 20, np.uint8) for _ in range(24)]  # 192 MiB in buffers of 8 MiB, touched
pin = np.ones(2 << 20, np.uint8)  # allocated after them, it keeps the heap's top in use (2 MiB: too large
# for a hole the imports left lower in the heap, where a small block landed in some layouts)
grown = current_rss_bytes() - base
del bufs
print(grown >> 20, (current_rss_bytes() - base) >> 20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_large_buffers_leave_the_process():
    # A fresh process each: in a long test process the heap may already hold large free
    # chunks (trimmed, so not resident), and glibc serves an 8 MiB request from them before
    # it considers mmap; what this checks is the threshold itself.
    import subprocess

    def grown_and_kept(arm):
        out = subprocess.run([sys.executable, "-c", _FREED_BUFFERS, arm], capture_output=True, text=True, check=True)
        return [int(x) for x in out.stdout.split()]

    grown, kept = grown_and_kept("default")  # without it: the buffers come from the heap and stay
    assert grown > 150 and kept > 150, (grown, kept)
    grown, kept = grown_and_kept("release")  # with it: each is mapped on its own and unmapped when freed
    assert grown > 150 and kept < 24, (grown, kept)


def _maps() -> int:
    with open("/proc/self/maps", "rb") as f:
        return sum(1 for _ in f)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/maps")
def test_compiled_programs_are_released_past_the_map_fraction():
    fns = [jax.jit(lambda x, i=i: jnp.cumsum(jnp.sin(x @ x.T) * i, axis=0) @ jnp.tanh(x)) for i in range(40)]
    release_compiled_programs(1e-9)
    before = _maps()
    for f in fns:
        f(jnp.ones((64, 64))).block_until_ready()
    compiled = _maps()
    assert all(f._cache_size() == 1 for f in fns)
    assert not release_compiled_programs(1.0)  # far below the limit: nothing is dropped
    assert all(f._cache_size() == 1 for f in fns)
    assert release_compiled_programs(1e-9)
    assert all(f._cache_size() == 0 for f in fns)
    assert _maps() < compiled and _maps() <= before + (compiled - before) // 4


@pytest.mark.parametrize("fraction", [0.0, -0.5, 1.5])
def test_release_compiled_programs_rejects_a_bad_fraction(fraction):
    with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\], got"):
        release_compiled_programs(fraction)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim")
def test_freed_small_blocks_go_back_with_trim_heap():
    # Blocks below the mmap threshold come from the heap; freed, they stay resident until trimmed.
    release_freed_buffers()
    blocks = [bytearray(b"x" * 60_000) for _ in range(4_000)]  # 240 MB of touched 60 kB blocks
    keep = blocks[-1]  # a live block at the heap's top: plain free() cannot shrink the heap past it
    del blocks
    before = current_rss_bytes()
    assert trim_heap()
    assert before - current_rss_bytes() > 150 << 20
    assert keep[0] == ord("x")


def test_drop_compiled_programs_frees_every_program():
    fns = [jax.jit(lambda x, i=i: jnp.sin(x) * i) for i in range(3)]
    outs = [np.asarray(f(jnp.ones(4))) for f in fns]
    assert all(f._cache_size() == 1 for f in fns)
    drop_compiled_programs()
    assert all(f._cache_size() == 0 for f in fns)
    np.testing.assert_array_equal([np.asarray(f(jnp.ones(4))) for f in fns], outs)  # compiled again, same values


def test_compile_then_trim_compiles_once_per_signature_from_shapes():
    from functools import partial

    from magicpig_jax import memory

    traces = []

    @partial(jax.jit, static_argnames="scale", donate_argnames="x")
    def f(x, y, scale):
        traces.append(1)
        return x * scale + y

    drop_compiled_programs()
    x, y = jnp.arange(6.0).reshape(2, 3), jnp.ones((3,))
    spec = jax.ShapeDtypeStruct((2, 3), jnp.float32)
    c = memory.compile_then_trim(f, spec, y, scale=2.0)  # x only as its shape: nothing allocated
    assert memory.compile_then_trim(f, x, y, scale=2.0) is c and len(traces) == 1  # same signature
    np.testing.assert_array_equal(np.asarray(c(x, y)), np.arange(6.0).reshape(2, 3) * 2 + 1)
    # another shape, dtype or static value is another program
    assert memory.compile_then_trim(f, jax.ShapeDtypeStruct((3, 3), jnp.float32), y, scale=2.0) is not c
    assert memory.compile_then_trim(f, jax.ShapeDtypeStruct((2, 3), jnp.bfloat16), y, scale=2.0) is not c
    assert memory.compile_then_trim(f, spec, y, scale=3.0) is not c
    assert len(traces) == 4
    with pytest.raises(TypeError):
        c(jnp.zeros((3, 3)), y)  # the program checks its arguments' shapes
    drop_compiled_programs()  # empties the cache: the next call compiles again
    assert memory.compile_then_trim(f, spec, y, scale=2.0) is not c and len(traces) == 5


def test_compile_then_trim_evicts_the_least_recently_used_program(monkeypatch):
    # An evaluation cycles its methods per document: the program used last must survive a new
    # one (oldest-first eviction would drop it and compile it again at every document).
    from magicpig_jax import memory

    drop_compiled_programs()
    monkeypatch.setattr(memory, "_COMPILED_SIZE", 2)
    fns = [jax.jit(lambda x, i=i: x + i) for i in range(3)]
    spec = jax.ShapeDtypeStruct((2,), jnp.float32)
    c0 = memory.compile_then_trim(fns[0], spec)
    memory.compile_then_trim(fns[1], spec)
    assert memory.compile_then_trim(fns[0], spec) is c0  # a hit makes fns[0] the most recent
    memory.compile_then_trim(fns[2], spec)  # evicts fns[1], the least recently used
    assert memory.compile_then_trim(fns[0], spec) is c0
    assert len(memory._COMPILED) == 2
    drop_compiled_programs()


def test_the_program_caches_are_safe_to_share_between_threads():
    # get-then-move_to_end on an OrderedDict raised KeyError when another thread evicted the key in
    # between (4 threads compiling 34 shapes through a 32-entry cache); the caches now do each
    # lookup and each insertion under one lock
    import sys
    import threading

    from magicpig_jax import decode_loop, memory
    from magicpig_jax.models import decoding

    assert all(isinstance(c, memory.LRUCache) for c in (memory._COMPILED, decode_loop._FLAT_STEPS,
                                                        decoding._STEP_CACHE))
    cache, errors = memory.LRUCache(), []

    def hammer(seed: int) -> None:
        try:
            for i in range(20000):
                key = (seed * 7 + i) % 34
                if cache.get(key) is None:
                    cache.put(key, object(), 32)
                assert len(cache) <= 32
        except Exception as err:  # noqa: BLE001 - any failure in a thread is the finding
            errors.append(err)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=hammer, args=(s,)) for s in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:1]
    assert len(cache) == 32 and len(cache.items()) == 32
    cache.clear()
    assert len(cache) == 0


def test_the_prefill_keeps_the_programs_of_the_last_few_cache_shapes(monkeypatch):
    """Every cache shape compiles its own prefill, decode step and index build, which JAX keeps: repeated
    prefills of growing prompts grew the process by each shape's code without bound. The prefill records
    its shapes, and a shape beyond the last RETAINED_SHAPES drops the compiled programs first."""
    from magicpig_jax import memory
    from magicpig_jax.generation import CHUNK, prefill
    from tests._tiny import tiny_model

    drop_compiled_programs()
    drops = []
    real = memory.drop_compiled_programs
    monkeypatch.setattr(memory, "drop_compiled_programs", lambda: (drops.append(1), real())[1])
    monkeypatch.setattr(memory, "RETAINED_SHAPES", 2)
    model = tiny_model()
    probe = jax.jit(lambda x: x + 1)  # a program of the caller's: dropped with the others
    probe(jnp.ones(3))
    sizes = [1, CHUNK + 1, 1, 2 * CHUNK + 1]  # capacities CHUNK, 2 CHUNK, CHUNK again, 3 CHUNK
    for n in sizes[:3]:
        prefill(model, [[5] * n], 4)
    assert drops == [] and probe._cache_size() == 1  # two shapes, one of them used twice
    prefill(model, [[5] * sizes[3]], 4)  # a third shape: the least recent one's programs go
    assert drops == [1] and probe._cache_size() == 0
    assert memory.note_program_shape(("x",)) is False  # room again: one shape recorded since the drop
    assert memory.note_program_shape(("y",)) is True and drops == [1, 1]
    prefill(model, [[5] * 3, [6] * 2], 4)  # a batch of 2 is another shape: the second recorded
    assert drops == [1, 1]
    prefill(model, [[5] * 3], 4, cache_dtype=jnp.bfloat16)  # another cache dtype: a third
    assert drops == [1, 1, 1]
    from magicpig_jax.generation import forward_logits

    forward_logits(model, [5] * (CHUNK + 3))  # its own prefill chunks count as the prefill's
    forward_logits(model, [5] * (2 * CHUNK + 3))
    assert drops == [1, 1, 1, 1]
    monkeypatch.setattr(memory, "RETAINED_SHAPES", 0)
    with pytest.raises(ValueError, match="RETAINED_SHAPES must be an int >= 1, got 0"):
        memory.note_program_shape(("z",))
    drop_compiled_programs()


def test_compile_then_trim_keys_static_values_by_type_and_value():
    """A NumPy scalar static argument was keyed by shape and dtype alone (np.float32(3.0) got the
    program of 2.0), 2 and 2.0 fell on one key although jit tells them apart, and an array on
    another device reused a program compiled for the first (a re-reviewer's findings)."""
    from functools import partial

    from magicpig_jax import memory

    @partial(jax.jit, static_argnames="scale")
    def f(x, scale):
        return x * scale

    drop_compiled_programs()
    x = jnp.ones(2)
    c2 = memory.compile_then_trim(f, x, scale=np.float32(2.0))
    c3 = memory.compile_then_trim(f, x, scale=np.float32(3.0))
    np.testing.assert_array_equal(np.asarray(c3(x)), [3.0, 3.0])
    assert c2 is not c3 and memory.compile_then_trim(f, x, scale=np.float32(2.0)) is c2
    assert memory.compile_then_trim(f, x, scale=2) is not memory.compile_then_trim(f, x, scale=2.0)
    np.testing.assert_array_equal(np.asarray(memory.compile_then_trim(f, x, scale=2.0)(x)), jax.jit(
        f, static_argnames="scale")(x, scale=2.0))
    drop_compiled_programs()


_TWO_DEVICES = """
import jax, jax.numpy as jnp, numpy as np
from magicpig_jax.memory import compile_then_trim
f = jax.jit(lambda x: x + 1)
x0 = jnp.ones(2)
x1 = jax.device_put(x0, jax.devices()[1])
c0 = compile_then_trim(f, jax.ShapeDtypeStruct((2,), jnp.float32))  # a shape: the default device's program
assert compile_then_trim(f, x0) is c0
c1 = compile_then_trim(f, x1)  # was c0, which refused x1 (compiled for other input shardings)
assert c1 is not c0 and np.asarray(c1(x1)).tolist() == [2.0, 2.0] and c1(x1).devices() == {jax.devices()[1]}
print("ok")
"""


def test_compile_then_trim_keeps_a_program_per_device():
    import os
    import subprocess

    from tests._xla import with_test_flag

    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=with_test_flag("--xla_force_host_platform_device_count=2"))
    out = subprocess.run([sys.executable, "-c", _TWO_DEVICES], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
