"""Argument checks shared by the host wrappers (and by ``distributed`` and ``offload``).

Each check raises ``TypeError`` or ``ValueError`` naming the bad parameter and the allowed
values, before anything reaches the C++ handlers (which check again and return an XLA error).
Pure JAX/NumPy: no compiled extension is needed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from magicpig_jax.attention._common import check_lengths
from magicpig_jax.attention.config import MagicPIGConfig
from magicpig_jax.host.index import HOST_MAX_K, HOST_MAX_L, HostIndex

__all__ = ["check_config", "check_int", "check_lengths_strict", "check_index", "check_kv_dtypes"]


def check_config(config: MagicPIGConfig) -> None:
    """Check that ``config`` is a :class:`MagicPIGConfig` the host index supports.

    Raises:
      TypeError: ``config`` is not a :class:`MagicPIGConfig`.
      ValueError: ``K`` outside ``[1, 16]`` (2^K + 1 bucket offsets per chunk and table) or
        ``L`` outside ``[2, 4096]``.
    """
    if not isinstance(config, MagicPIGConfig):
        raise TypeError(f"config must be a MagicPIGConfig, got {type(config).__name__}")
    if not 1 <= config.K <= HOST_MAX_K:
        raise ValueError(
            f"K must be in [1, {HOST_MAX_K}] for the host index (2^K + 1 bucket offsets per "
            f"chunk and table), got K={config.K}; use the pure-JAX path (attention 'magicpig-ref') for larger K"
        )
    if not 2 <= config.L <= HOST_MAX_L:
        raise ValueError(f"L must be in [2, {HOST_MAX_L}] for the host index, got L={config.L}")


def check_pool_threads(max_threads: object) -> int:
    """A thread cap on XLA's intra-op pool (0: all of it; a Python or NumPy int), as the ops' int64
    attribute takes it.

    Raises:
      ValueError: not an int >= 0 (a bool included), or not below 2**31.
    """
    if isinstance(max_threads, bool | np.bool_) or not isinstance(max_threads, int | np.integer) or max_threads < 0:
        raise ValueError(f"max_threads must be an int >= 0, got {max_threads!r}")
    if max_threads >= 2**31:
        raise ValueError(f"max_threads must be below 2**31, got {max_threads}")
    return int(max_threads)


def check_int(name: str, value: object, lo: int, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]``.

    Raises:
      TypeError: ``value`` is not an int (a bool is not).
      ValueError: ``value`` is outside ``[lo, hi]``.
    """
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {name}={value}")
    return int(value)


def check_lengths_strict(lengths, B: int, N: int, name: str = "lengths") -> jax.Array:
    """Like :func:`~magicpig_jax.attention._common.check_lengths` (int ``[B]``, default N), but
    concrete values outside ``[0, N]`` raise ``ValueError`` instead of being clipped."""
    if lengths is not None and not isinstance(lengths, jax.core.Tracer):
        arr = np.asarray(lengths)
        if arr.shape == (B,) and np.issubdtype(arr.dtype, np.integer):
            if arr.size and (arr.min() < 0 or arr.max() > N):
                raise ValueError(f"{name} must be in [0, {N}] (the KV capacity), got {arr.tolist()}")
    return check_lengths(lengths, B, N)


def check_kv_dtypes(k, v) -> None:
    """Check that the cache is what the ops read in place.

    Raises:
      TypeError: ``k`` and ``v`` are not both float32 or both bfloat16.
    """
    if k.dtype != v.dtype or k.dtype not in (jnp.float32, jnp.bfloat16):
        raise TypeError(f"k and v must both be float32 or both bfloat16, got {k.dtype} and {v.dtype}")


def check_index(index: HostIndex, config: MagicPIGConfig, B: int, Hkv: int, D: int) -> None:
    """Check that ``index`` is a :class:`HostIndex` of ``config`` for a ``[B, Hkv, N, D]`` cache.

    Raises:
      TypeError: ``index`` is not a :class:`HostIndex`.
      ValueError: its ``K``/``L`` differ from ``config``'s, it was built with another ``num_sink`` /
        ``num_local`` (its static set is ``[0, index.start)`` and ``[index.end, lengths)``: a smaller
        ``num_sink`` would drop sink tokens), or a buffer has the wrong shape or dtype.
    """
    if not isinstance(index, HostIndex):
        raise TypeError(f"index must be a HostIndex, got {type(index).__name__}")
    if (index.K, index.L) != (config.K, config.L):
        raise ValueError(f"index was built with K={index.K}, L={index.L} but config has K={config.K}, "
                         f"L={config.L}")
    for name in ("num_sink", "num_local"):
        built, asked = getattr(index, name), getattr(config, name)
        if built is not None and built != asked:
            raise ValueError(f"the index was built with {name}={built} but config has {name}={asked}: "
                             f"build the index with this config")
    check_index_buffers(index, B, Hkv, D)


def check_index_buffers(index: HostIndex, B: int, Hkv: int, D: int) -> None:
    """Check that ``index`` is a :class:`HostIndex` whose buffers fit a ``[B, Hkv, N, D]`` cache
    (its own K and L).

    Raises:
      TypeError: ``index`` is not a :class:`HostIndex` (a pure-JAX ``LSHIndex``, say).
      ValueError: a buffer has the wrong shape or dtype (named, with the expected one).
    """
    if not isinstance(index, HostIndex):
        raise TypeError(f"index must be a HostIndex (host_build_index), got {type(index).__name__}")
    K, L = index.K, index.L
    nc, ch = index.ids.shape[2], index.ids.shape[4]
    expect = {
        "ids": ((B, Hkv, nc, L, ch), jnp.uint16),
        "offsets": ((B, Hkv, nc, L, (1 << K) + 1), jnp.uint16),
        "open_codes": ((B, Hkv, L, index.open_codes.shape[-1]), jnp.uint16),
        "bounds": ((B, 3), jnp.int32),
        "mean": ((B, Hkv, D), jnp.float32),
        "projections": ((D, K * L), jnp.float32),
    }
    for name, (shape, dtype) in expect.items():
        x = getattr(index, name)
        if tuple(x.shape) != shape or x.dtype != dtype:
            raise ValueError(
                f"index.{name} must be {jnp.dtype(dtype).name} {list(shape)}, got {x.dtype} {list(x.shape)}"
            )
