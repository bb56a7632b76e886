"""The measured cost of a decode run: milliseconds per step and the bytes a step reads.

The fraction of keys a method touches flatters exact TopK, which must score every key of a
layer to find its top set, while MagicPIG reads only its sampled rows and a few buckets. The
evaluation therefore reports, next to the fraction:

* ``ms_per_step``: the wall time of a whole decode step (the model, every layer's attention,
  sampling), measured by the decode loop over the steps after the first (which compiles);
* ``bytes_per_step``: the bytes of K, V, index and page metadata the attention of one step
  must read at the method's best implementation on the host (:func:`step_bytes`): what the
  host ops (``host_ops/``) read, not what an XLA fallback happens to touch.

Per layer and row, with ``n`` cached keys at the step, ``e`` bytes per K/V element, ``D``
the head dim, ``Hkv`` KV heads, ``Hq`` query heads, ``s`` the static keys (sinks + unhashed
tail) and ``m = n - s`` the middle (hashed) range, and ``c_h`` the keys a query head used:

====================  =======================================================================
dense layer           K and V of every key: ``2 n Hkv D e``
static set (sparse)   K and V of the static keys: ``2 s Hkv D e``
MagicPIG, hybrid      K and V of each head's sampled rows ``2 D e sum_h c_h``; index: per query
                      head and table two uint16 bucket offsets and the bucket's uint16 ids,
                      ``Hq L (4 + 2 m / 2^K)`` (buckets of the expected uniform size ``m/2^K``),
                      and the float32 SimHash hyperplanes that hash the query, ``4 D K L``
TopK                  K of the whole middle range once per KV head ``m Hkv D e`` (every key is
                      scored), V of each head's kept rows ``D e sum_h c_h``
Quest                 page bounds ``2 P Hkv D 4`` (float32 min and max, ``P = ceil(m / page)``),
                      K and V of the kept pages' rows ``2 D e sum_h c_h``
oracle sampling       K of the middle range (the exact softmax) ``m Hkv D e``, V of the drawn rows
====================  =======================================================================

``c_h`` comes from the run's measured ``sampled_fraction_per_layer`` (the mean over steps and
heads of ``keys used / context``), so the byte count is an average over the run's steps.

What the ``G`` query heads of a KV head share (the static keys, TopK's scored K, Quest's page
bounds) is counted once per KV head: the ops read it per query head, back to back, so the
siblings' reads hit the cache (``docs/host_op.md``); what each query head selects on its own
(sampled or kept rows) is counted per query head. The model assumes the eval's decodes, which
never append generated keys to an index (``magicpig-jax eval`` and ``calibrate`` refuse longer
ones, :data:`LONGEST_MODELLED_DECODE`): the tokens generated so far belong to the static tail.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from magicpig_jax.attention.config import GENERATION_BUFFER

__all__ = ["ms_per_step", "step_bytes", "BYTE_PARTS", "LONGEST_MODELLED_DECODE"]

# The most tokens a decode after one prefill may take for :func:`step_bytes` to hold: generated tokens
# stay in the static set until 2 x GENERATION_BUFFER of them are held, then the decoder hashes them
# into the index, which the count does not model.
LONGEST_MODELLED_DECODE = 2 * GENERATION_BUFFER - 1

BYTE_PARTS = ("k", "v", "index", "pages")


def ms_per_step(stats: Mapping) -> float | None:
    """Milliseconds per decode step after the first (None with fewer than 2 steps).

    Args:
      stats: a decode run's stats (:meth:`magicpig_jax.decode_loop.DecodeRun.stats`).
    """
    steps, seconds = stats.get("decode_steps") or 0, stats.get("decode_seconds") or 0.0
    if steps < 2 or seconds <= 0:
        return None
    return 1000.0 * seconds / (steps - 1)


def _layer_kl(layer: int, per_layer_kl: Mapping | None, default: tuple[int, int]) -> tuple[int, int]:
    if per_layer_kl and str(layer) in per_layer_kl:
        k, l_ = per_layer_kl[str(layer)]
        return int(k), int(l_)
    if per_layer_kl and layer in per_layer_kl:
        k, l_ = per_layer_kl[layer]
        return int(k), int(l_)
    return default


def step_bytes(backend: str, *, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
               context: float, dense_layers, fraction_per_layer: Mapping, num_sink: int, num_local: int,
               kv_bytes: int = 4, K: int | None = None, L: int | None = None,
               layer_kl: Mapping | None = None, page_size: int = 16, unhashed_tail: float | None = None,
               layer_windows: Mapping | None = None) -> dict:
    """Bytes of K, V, index and page metadata the attention of one decode step reads (one row).

    See the module docstring for the model of each method.

    Args:
      backend: ``dense``, ``magicpig``, ``magicpig-ref``, ``hybrid``, ``topk``, ``quest`` or ``oracle``.
      num_layers, num_heads, num_kv_heads, head_dim: the model's shape.
      context: mean cached keys at a step (``n``).
      dense_layers: layers attended densely (all of them for ``dense``).
      fraction_per_layer: layer -> mean fraction of the context's keys a query head used in the
        middle range (the run's ``sampled_fraction_per_layer``; keys may be str or int).
      num_sink, num_local: the static set.
      kv_bytes: bytes per K/V element (4 float32, 2 bfloat16).
      K, L: MagicPIG's bits and tables (MagicPIG and hybrid), unless ``layer_kl`` gives them per layer.
      layer_kl: optional layer -> ``(K, L)``.
      page_size: Quest's page.
      unhashed_tail: keys after the middle range (default ``num_local``: the prompt's local window).
      layer_windows: optional layer -> sliding window W: a dense layer with one reads at most W keys
        (a window that binds makes its layer dense in :func:`~magicpig_jax.generation.decode_spec`;
        one that does not leaves it sparse, counted as the others).

    Returns:
      ``{"k", "v", "index", "pages", "total"}`` in bytes (floats).

    Raises:
      ValueError: an unknown backend, or MagicPIG without K and L.
    """
    known = ("dense", "magicpig", "magicpig-ref", "hybrid", "topk", "quest", "oracle")
    if backend not in known:
        raise ValueError(f"backend must be one of {known}, got {backend!r}")
    n = float(context)
    D, Hkv, Hq, e = head_dim, num_kv_heads, num_heads, kv_bytes
    dense = set(range(num_layers)) if backend == "dense" else {int(x) for x in dense_layers}
    tail = float(num_local if unhashed_tail is None else unhashed_tail)
    s = min(n, num_sink + tail)
    m = max(n - s, 0.0)
    out = dict.fromkeys(BYTE_PARTS, 0.0)
    frac = {int(k): float(v) for k, v in fraction_per_layer.items()}
    windows = {int(k): int(v) for k, v in (layer_windows or {}).items()}
    for layer in range(num_layers):
        if layer in dense:
            read = min(n, windows.get(layer, n))
            out["k"] += read * Hkv * D * e
            out["v"] += read * Hkv * D * e
            continue
        out["k"] += s * Hkv * D * e
        out["v"] += s * Hkv * D * e
        used = frac.get(layer, 0.0) * n * Hq  # sum over query heads of the keys each used
        if backend in ("magicpig", "magicpig-ref", "hybrid"):
            k_bits, tables = _layer_kl(layer, layer_kl, (K or 0, L or 0))
            if not k_bits or not tables:
                raise ValueError(f"{backend}: K and L are needed for layer {layer}")
            out["k"] += used * D * e
            out["v"] += used * D * e
            out["index"] += Hq * tables * (4 + 2 * m / 2**k_bits) + 4 * D * k_bits * tables
        elif backend == "topk":
            out["k"] += m * Hkv * D * e
            out["v"] += used * D * e
        elif backend == "quest":
            out["pages"] += 2 * math.ceil(m / page_size) * Hkv * D * 4
            out["k"] += used * D * e
            out["v"] += used * D * e
        elif backend == "oracle":
            out["k"] += m * Hkv * D * e
            out["v"] += used * D * e
    out["total"] = sum(out[p] for p in BYTE_PARTS)
    return out
