"""The process's resident memory: its peak, and returning freed buffers to the OS.

``peak_rss_bytes()`` is what ``generate --json`` reports (``getrusage(RUSAGE_SELF).ru_maxrss``,
the peak since the process started, or since the peak mark was last reset: writing 5 to
``/proc/self/clear_refs``, as ``bench decode`` does before each configuration
(:class:`magicpig_jax.eval.rss.PeakRSS`), resets ``ru_maxrss`` too, and so what
``/usr/bin/time -v`` reports for the process).

``release_compiled_programs()`` drops JAX's compiled programs when the process nears the
kernel's limit on memory mappings (``vm.max_map_count``): every XLA CPU executable maps its
code in several regions, and a process that compiles thousands of programs (a long study, a
test suite) otherwise dies in the compiler when ``mmap`` fails.

``release_freed_buffers()`` tunes glibc's allocator so that buffers of at least 4 MiB (KV
cache layers, index tables, XLA temporaries) are mapped on their own and unmapped when
freed. By default glibc raises its mmap threshold to the size of the largest buffer freed
so far (up to 32 MiB), after which such buffers come from the heap and stay resident once
freed: a long decode kept hundreds of MB of freed cache copies resident that way
(docs/benchmarks.md, "Memory").
:func:`magicpig_jax.io.loader.load_model` calls it.

``drop_compiled_programs()`` frees every compiled program now and returns the freed heap to
the OS (``malloc_trim``). A one-shot process calls it between phases that never run again
(the prefill, a finished decode backend, the index build): XLA's compiled code and the
compiler's freed working memory otherwise stay resident until the process exits, and a
30-layer program is tens of megabytes of it. A process that will call the same programs
again (a server, repeated ``generate()`` calls) should not: they compile again.

``note_program_shape()`` bounds how many cache shapes keep their compiled programs. Every new
KV-cache size (a batch size, a capacity: prompts are rounded up to 256 tokens) compiles a new
prefill chunk, decode step and index build, about a hundred megabytes of code for a 30-layer
model that JAX keeps for the life of the process: repeated ``generate()`` calls on prompts of
growing lengths grew the process by that much per 256 tokens, several GB over an 8K context.
The prefill records each shape it serves, and when a fifth shape arrives (``RETAINED_SHAPES``,
4) it drops every compiled program first (:func:`drop_compiled_programs`; JAX cannot free one
shape's programs alone) and starts counting again: at most 4 shapes' programs are held, and a
workload that cycles through more shapes compiles each again when it returns to it.

``compile_then_trim()`` compiles a jitted function ahead of its call, from the arguments'
shapes, and then trims the heap. The prefill compiles its chunk before allocating the KV
cache, and a decode compiles its step and its index build before building the index: the
compiler's working memory (a 30-layer program takes over a hundred megabytes while it
compiles) is then gone before the cache and the index exist, instead of adding to them.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import resource
import sys

__all__ = ["peak_rss_bytes", "current_rss_bytes", "release_freed_buffers", "release_compiled_programs",
           "drop_compiled_programs", "trim_heap", "compile_then_trim", "note_program_shape", "RETAINED_SHAPES"]

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameters
_MMAP_THRESHOLD = 4 << 20
_done = False


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since it started or since the peak mark was last
    reset (``/proc/self/clear_refs``; see the module docstring), in bytes (``ru_maxrss``)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) * (1 if sys.platform == "darwin" else 1024)


def current_rss_bytes() -> int:
    """Resident set size now, in bytes (``VmRSS``; 0 where ``/proc`` is not available)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _map_count_and_limit() -> tuple[int, int] | None:
    """``(memory mappings of this process, vm.max_map_count)``; None where ``/proc`` lacks them."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            count = sum(1 for _ in f)
    except (OSError, ValueError):
        return None
    return count, limit


def release_compiled_programs(fraction: float = 0.5) -> bool:
    """Clear JAX's caches of compiled programs if this process holds many memory mappings.

    Args:
      fraction: clear when the mappings exceed this fraction of ``vm.max_map_count``
        (in ``(0, 1]``).

    Returns:
      whether the caches were cleared (``jax.clear_caches()``, then a garbage collection so
      the executables are freed and their code unmapped). Programs compile again when next
      called. False where ``/proc`` does not say (not Linux).

    Raises:
      ValueError: ``fraction`` outside ``(0, 1]``.
    """
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"fraction must be in (0, 1], got {fraction}")
    counted = _map_count_and_limit()
    if counted is None or counted[0] <= fraction * counted[1]:
        return False
    drop_compiled_programs()
    return True


def drop_compiled_programs() -> None:
    """Free JAX's compiled programs now, and return the freed heap to the OS.

    ``jax.clear_caches()``, a garbage collection (so the executables are destroyed and their
    code unmapped), then :func:`trim_heap`. Programs compile again when next called: for
    phases of a one-shot run that will not run again (see the module docstring).
    """
    import gc

    import jax

    jax.clear_caches()
    _COMPILED.clear()
    _SHAPES.clear()
    gc.collect()
    trim_heap()


def compile_then_trim(jitted, *args, **kwargs):
    """Compile ``jitted`` for these arguments now, then :func:`trim_heap`.

    Args:
      jitted: a ``jax.jit``-wrapped function.
      *args, **kwargs: its arguments as they will be passed, static ones included; array
        arguments may be ``jax.ShapeDtypeStruct`` (nothing is allocated for them).

    Returns:
      The ``jax.stages.Compiled`` program. Call it with the non-static arguments only, passed
      the same way (positionally or by name) as here; it checks their shapes and dtypes and
      raises ``TypeError`` on a mismatch. Donation is the jitted function's.

    Programs are kept by the arguments' structure, shapes and dtypes (and the static values),
    so a second call with the same signature returns the same program without tracing again
    (a bounded cache of the last few; :func:`drop_compiled_programs` empties it).
    """
    key = _signature(jitted, args, kwargs)
    compiled = _COMPILED.get(key) if key is not None else None
    if compiled is None:
        compiled = jitted.lower(*args, **kwargs).compile()
        trim_heap()
        if key is not None:
            _COMPILED.put(key, compiled, _COMPILED_SIZE)
    return compiled


class LRUCache:
    """A bounded mapping that evicts the least recently used entry first, safe to share between threads.

    The caches of compiled programs (here, the decode steps of :mod:`magicpig_jax.models.decoding`
    and the chunked steps of :mod:`magicpig_jax.decode_loop`) are module-level: two threads decoding
    at once must not see an entry vanish between its lookup and its use (an ``OrderedDict``'s
    ``get`` then ``move_to_end`` raised ``KeyError`` when another thread evicted the key between
    them). A value is looked up and moved, or inserted and the oldest evicted, under one lock;
    building a value (compiling) happens outside it, so two threads may build the same one.
    """

    def __init__(self) -> None:
        import threading

        self._data: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        """The value of ``key`` (now the most recently used), or None."""
        with self._lock:
            value = self._data.get(key)
            if value is not None:
                self._data.move_to_end(key)
            return value

    def put(self, key, value, maxsize: int) -> None:
        """Store ``value`` under ``key``, then evict the least recently used down to ``maxsize`` entries."""
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > maxsize:
                self._data.popitem(last=False)

    def clear(self) -> None:
        """Drop every entry."""
        with self._lock:
            self._data.clear()

    def items(self) -> list:
        """A snapshot of the ``(key, value)`` pairs, least recently used first."""
        with self._lock:
            return list(self._data.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


# Least recently used evicted first. Sized for an evaluation that cycles a dozen decode methods
# per document (one step program each, plus the prefill's): a smaller or oldest-first cache
# compiles every method again for every document.
_COMPILED = LRUCache()
_COMPILED_SIZE = 32

RETAINED_SHAPES = 4  # at most this many cache shapes' compiled programs are held (note_program_shape); >= 1
_SHAPES = LRUCache()


def note_program_shape(key) -> bool:
    """Record that programs for the cache shape ``key`` are about to compile or run; when ``key`` is
    new and ``RETAINED_SHAPES`` other shapes are recorded, drop every compiled program first (all
    of them: JAX frees no single shape's programs) and forget the recorded shapes.

    Args:
      key: hashable, e.g. ``(model config, batch size, cache capacity, cache dtype)``.

    Returns:
      True when the compiled programs were dropped.

    Raises:
      ValueError: ``RETAINED_SHAPES`` (a module setting) is not an int >= 1.

    Dropping is :func:`drop_compiled_programs`, which clears every JAX cache of the process
    (``jax.clear_caches()``): a caller's own jitted functions compile again at their next call.
    Set ``magicpig_jax.memory.RETAINED_SHAPES`` higher to keep more shapes' programs (each costs
    its code's memory), or call the prefill with few distinct shapes.
    """
    limit = RETAINED_SHAPES
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"magicpig_jax.memory.RETAINED_SHAPES must be an int >= 1, got {limit!r}")
    if _SHAPES.get(key) is not None:
        return False
    dropped = len(_SHAPES) >= limit
    if dropped:
        drop_compiled_programs()  # forgets the recorded shapes too
    _SHAPES.put(key, True, limit)
    return dropped


def _signature(jitted, args, kwargs):
    """A hashable key of a call's signature, or None when a leaf is not hashable.

    Array leaves (JAX and NumPy arrays, ``jax.ShapeDtypeStruct``) count by shape, dtype, weak type
    and sharding (a program compiled for device 0 refuses an array on device 1); every other leaf,
    NumPy scalars included, by type and value: either may be a static argument, which jit keys by
    value (``np.float32(2.0)`` and ``np.float32(3.0)`` had shared one program, as had ``2`` and
    ``2.0``, which jit tells apart).
    """
    import jax
    import numpy as np

    leaves, treedef = jax.tree.flatten((args, kwargs))
    device = jax.config.jax_default_device  # a Device, a platform name, or None
    if not isinstance(device, jax.Device):
        device = jax.devices(device)[0] if isinstance(device, str) else jax.devices()[0]
    default = jax.sharding.SingleDeviceSharding(device)
    sig = []
    for x in leaves:
        if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
            sharding = getattr(x, "sharding", None)  # the default device's is a shape's (None): one program
            sig.append((tuple(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                        None if sharding == default else sharding))
        else:
            sig.append((type(x), x))
    key = (jitted, treedef, tuple(sig))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def trim_heap() -> bool:
    """Return the free memory of glibc's heaps to the OS (``malloc_trim(0)``).

    Freed blocks below the mmap threshold stay in the heap, resident, until the heap's top is
    free; ``malloc_trim`` also releases whole free pages inside it. Returns ``malloc_trim``'s
    result: True when glibc returned or advised away any pages, which it also does for pages
    already released, so True does not mean that the RSS fell (False where the C library is
    not glibc).
    """
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim(0) == 1


def release_freed_buffers() -> bool:
    """Make glibc map buffers of >= 4 MiB on their own (freed ones go back to the OS).

    A fixed ``M_MMAP_THRESHOLD`` also turns off glibc's dynamic threshold. Idempotent; a
    no-op (False) where the C library is not glibc. Returns whether the setting is in effect.
    """
    global _done
    if _done:
        return True
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _done = mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD) == 1
    return _done
