"""MagicPIG on host memory: the LSH index, sampled and exact attention, and the quantized decode
matvec as XLA FFI custom calls (CPU).

The C++ handlers (``host_ops/``, built by ``pip install`` into ``magicpig_jax._host_ops``) are
registered with ``jax.ffi.register_ffi_target(..., platform="cpu")`` by the first host call,
not by importing this package (:mod:`magicpig_jax.host._ext`). Everything they read and write
is an XLA buffer: the index is the pytree :class:`HostIndex` returned by
:func:`host_build_index` and passed back in, so it lives in host memory as JAX arrays, works
inside ``jax.jit``, and the handlers keep no state between calls (they are safe to run from
several threads). Source: arXiv 2410.16179, Sections 4.2-4.3.

Rooms:

* :mod:`~magicpig_jax.host._ext`: loading the extension and registering its targets;
  :func:`advise_huge_pages`, :func:`has_avx2`;
* :mod:`~magicpig_jax.host.index`: the :class:`HostIndex` pytree, its layout and bytes;
* :mod:`~magicpig_jax.host.validate`: the argument checks the wrappers share;
* :mod:`~magicpig_jax.host.log_u`: the float64 ``log u`` table of the kernel;
* :mod:`~magicpig_jax.host.simhash`: :func:`host_simhash_codes` (keys at build and append, queries at each step);
* :mod:`~magicpig_jax.host.build`: :func:`host_build_index`, :func:`host_append`;
* :mod:`~magicpig_jax.host.attention`: :func:`host_sampled_attention`, :func:`host_magicpig_attention`;
* :mod:`~magicpig_jax.host.exact`: :func:`host_exact_attention` (the dense layers);
* :mod:`~magicpig_jax.host.matvec`: :func:`quant_matvec` on GGUF blocks;
* :mod:`~magicpig_jax.host.topk`: :func:`host_topk_attention` (the TopK baseline);
* :mod:`~magicpig_jax.host.quest`: :class:`QuestPages`, :func:`host_quest_attention` (the Quest baseline).
"""

from __future__ import annotations

from magicpig_jax.host._ext import advise_huge_pages, has_avx2
from magicpig_jax.host.attention import host_magicpig_attention, host_sampled_attention
from magicpig_jax.host.build import host_append, host_build_index, host_key_codes
from magicpig_jax.host.exact import MAX_GROUP, host_exact_attention
from magicpig_jax.host.index import (
    DEFAULT_OPEN_CAPACITY,
    HOST_MAX_K,
    HOST_MAX_L,
    HostIndex,
    chunk_geometry,
    index_nbytes,
)
from magicpig_jax.host.log_u import host_log_u, log_u_table
from magicpig_jax.host.matvec import BLOCK_SIZE, QUANT_TYPES, block_bytes, packed_row_bytes, quant_matvec
from magicpig_jax.host.quest import QuestPages, host_quest_attention, quest_append_pages, quest_build_pages
from magicpig_jax.host.simhash import host_simhash_codes
from magicpig_jax.host.topk import host_topk_attention

__all__ = [
    "HostIndex",
    "host_build_index",
    "host_append",
    "host_key_codes",
    "host_simhash_codes",
    "host_sampled_attention",
    "host_magicpig_attention",
    "host_exact_attention",
    "host_topk_attention",
    "host_quest_attention",
    "QuestPages",
    "quest_build_pages",
    "quest_append_pages",
    "host_log_u",
    "log_u_table",
    "index_nbytes",
    "chunk_geometry",
    "has_avx2",
    "advise_huge_pages",
    "quant_matvec",
    "block_bytes",
    "packed_row_bytes",
    "HOST_MAX_K",
    "HOST_MAX_L",
    "DEFAULT_OPEN_CAPACITY",
    "MAX_GROUP",
    "QUANT_TYPES",
    "BLOCK_SIZE",
]
