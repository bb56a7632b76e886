"""Loading the compiled extension and registering its XLA FFI targets (lazily, once).

The C++ handlers (``host_ops/``, built by ``pip install`` through scikit-build-core + CMake
into ``magicpig_jax._host_ops``, or the library named by ``$MAGICPIG_HOST_OPS_LIB``, e.g. the
sanitizer build of ``make asan``) are registered with
``jax.ffi.register_ffi_target(..., platform="cpu")`` by the first call of :func:`ops`. Every
host wrapper calls it before its ``jax.ffi.ffi_call``, so importing :mod:`magicpig_jax.host`
never needs the compiled extension; only running a host op does.

Internal API of the host package: :func:`ops`, :data:`IMPLS`, :func:`impl_code`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading

import jax

__all__ = ["EXTENSION", "IMPLS", "ops", "impl_code", "advise_huge_pages", "has_avx2"]

EXTENSION = "magicpig_jax._host_ops"
# The kernel variants of the ``impl`` attribute of the ops: 0 picks AVX2/FMA where the CPU has it.
IMPLS = {"auto": 0, "scalar": 1, "avx2": 2}

_lock = threading.Lock()
_module = None


def _load():
    path = os.environ.get("MAGICPIG_HOST_OPS_LIB")
    if path:
        spec = importlib.util.spec_from_file_location(EXTENSION, path)
        if spec is None or spec.loader is None:
            raise ImportError(f"MAGICPIG_HOST_OPS_LIB={path!r} is not a loadable extension module")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    try:
        return importlib.import_module(EXTENSION)
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            f"{EXTENSION} is not built; reinstall the package with "
            "`pip install -e .` (scikit-build-core + CMake compile host_ops/)"
        ) from e


def ops():
    """The extension module, imported and its FFI targets registered on the first call (thread-safe).

    Returns:
      The ``magicpig_jax._host_ops`` module (or the one loaded from ``$MAGICPIG_HOST_OPS_LIB``).

    Raises:
      ImportError: the extension is not built, or ``$MAGICPIG_HOST_OPS_LIB`` is not loadable.
    """
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is None:
            mod = _load()
            for name, capsule in mod.registrations().items():
                jax.ffi.register_ffi_target(name, capsule, platform="cpu")
            _module = mod
    return _module


def impl_code(impl: str) -> int:
    """The ``impl`` attribute of the ops for ``"auto"``, ``"scalar"`` or ``"avx2"``.

    Raises:
      ValueError: any other ``impl``.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {sorted(IMPLS)}, got {impl!r}")
    return IMPLS[impl]


def advise_huge_pages(*trees) -> int:
    """Ask Linux to back the CPU buffers of ``trees`` with 2 MiB transparent huge pages.

    The sampled-attention op reads K/V rows and bucket lists at random places in arrays of
    hundreds of MB; with 4 KiB pages nearly every row misses the TLB. This applies
    ``madvise(MADV_HUGEPAGE)`` and ``madvise(MADV_COLLAPSE)`` (Linux >= 6.1) to the 2 MiB
    aligned interior of each CPU buffer. Values are unchanged; call it once on buffers that
    stay in place (the decoder does, for the cache and host indices it donates every step).

    Args:
      trees: arrays or pytrees of arrays (e.g. a :class:`~magicpig_jax.host.HostIndex`, a KV cache).

    Returns:
      Bytes now backed by huge pages (0 where the kernel or platform does not support it,
      e.g. non-Linux, THP disabled, or non-CPU arrays). Never raises for those cases.

    Raises:
      ImportError: the native extension is not built.
    """
    mod = ops()
    total = 0
    for leaf in jax.tree.leaves(trees):
        if not isinstance(leaf, jax.Array):
            continue
        for shard in leaf.addressable_shards:
            data = shard.data
            if next(iter(data.devices())).platform != "cpu" or data.nbytes < (2 << 20):
                continue
            try:
                ptr = data.unsafe_buffer_pointer()
            except Exception:  # noqa: BLE001 - e.g. deleted or non-contiguous buffers: skip them
                continue
            total += int(mod.advise_huge_pages(ptr, data.nbytes))
    return total


def has_avx2() -> bool:
    """Whether the CPU runs the AVX2/FMA kernels (``impl="auto"`` then uses them).

    Raises:
      ImportError: the native extension is not built.
    """
    return bool(ops().has_avx2())
