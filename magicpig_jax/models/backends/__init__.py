"""Decode attention backends of the Llama decoder: one table, one entry per method.

Every sparse backend keeps the static set exact — the first ``num_sink`` tokens, the last
``num_local`` prompt tokens and the generated tokens not yet in the sampled set — and applies
its method to the hashed range ``[start, end)`` of :meth:`MagicPIGConfig.hashed_range`, so the
methods are compared like for like (arXiv 2410.16179, Section 5).

Each :class:`Backend` has four parts, called by the decoder in this order:

  build       (inside jit, after prefill) the per-layer decode state of a sparse layer;
  prepare     (outside jit, once) place the cache and that state in memory (huge pages for
              the host op; the host device for offload) and return them;
  attend      (inside the decode step) ``(out, lse, keys_used)`` of a sparse layer;
  after_step  (inside the decode step, after the cache write) update the state
              (the host index appends generated tokens when a generation buffer is due).

``attend_dense`` is the exact attention of the layers kept dense under the backend;
``make_step``, when set, replaces the jitted decode step (offload runs each step as a
sequence of accelerator and host computations, :mod:`magicpig_jax.offload`).
:func:`backend_for` is the one place that chooses the entry for a :class:`DecodeSpec`:

  dense         exact attention over every cached key (no sparse layer); on the CPU backend the
                host exact op (:mod:`magicpig_jax.host.exact`), which reads a bfloat16 cache in place.
  magicpig      LSH sampling; on the CPU backend the index and the sampled attention run in
                the host op (:mod:`magicpig_jax.host`); on a GPU/TPU backend the paper's
                system: the sparse layers' KV cache and index in host memory, the host op
                there, everything else on the accelerator ("magicpig-offload").
  magicpig-ref  LSH sampling, pure-JAX reference (:func:`magicpig_attention`).
  topk          exact TopK of the hashed range (``budget`` keys); on the CPU backend the host op
                (:mod:`magicpig_jax.host.topk`: every key scored, a partial selection), else pure JAX.
  quest         Quest page selection in the hashed range (``budget`` keys, ``page_size`` pages); on
                the CPU backend the host op over page bounds kept with the cache
                (:mod:`magicpig_jax.host.quest`), else pure JAX.
  oracle        oracle sampling (Def. 3.1) of ``budget`` draws from the hashed range.
  hybrid        the hybrid LSH estimator (:mod:`magicpig_jax.attention.hybrid`): keys that collide
                in ``>= heavy`` tables kept exactly, the rest weighted by ``1/u_c`` (pure JAX).

The host entries (MagicPIG's, TopK's and Quest's) move generated tokens into the range on
MagicPIG's schedule (:func:`append_due`), so their static part is a bounded window; the pure-JAX
entries (``magicpig-ref``, ``oracle``, ``hybrid``, and TopK and Quest without the host op) keep the
range of the prefill, every generated token exact. The two give the same results while no append
is due (the first ``static_window - num_local`` generated tokens, 512 by default); past that,
``magicpig-ref`` keeps exact the tokens the host op samples, so it is the host op's reference for
the prompt's keys, not for a long generation's.

A :class:`~magicpig_jax.attention.LayerConfigs` in :attr:`DecodeSpec.layers` gives each layer its
own MagicPIG configuration (or keeps it dense): the chosen entry is wrapped (:func:`per_layer`) so
that each layer's state carries its configuration.

With a mesh (:func:`magicpig_jax.distributed.make_mesh`) the host entry is wrapped so each
device runs the op on its shard of rows and KV heads (:func:`sharded`).
"""
from magicpig_jax.models.backends.host import HostOps, append_due, sharded
from magicpig_jax.models.backends.spec import (
    BACKENDS,
    BUDGETED,
    HOST_BACKENDS,
    LAYERED,
    Backend,
    DecodeSpec,
    MiddleRange,
    SharedProjections,
    drop_projections,
    layer_projections,
    projection_sources,
    resolve_projections,
    with_shared_projections,
)
from magicpig_jax.models.backends.table import LayerState, backend_for, per_layer

__all__ = ["BACKENDS", "BUDGETED", "HOST_BACKENDS", "LAYERED", "Backend", "DecodeSpec", "HostOps", "LayerState",
           "MiddleRange", "SharedProjections", "append_due", "backend_for", "drop_projections", "layer_projections",
           "per_layer", "projection_sources", "resolve_projections", "sharded", "with_shared_projections"]
