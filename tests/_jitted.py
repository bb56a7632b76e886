"""Jitted entry points shared by the estimator tests.

One compilation per shape is much cheaper than op-by-op eager dispatch on a 2-core
CI machine; the runtime shape checks still run (at trace time).
"""

import jax

from magicpig_jax.attention import (
    build_lsh_index,
    dense_attention,
    magicpig_attention,
    merge_attention,
    oracle_sampling_attention,
    quest_attention,
    topk_attention,
)

dense_j = jax.jit(dense_attention)
merge_j = jax.jit(merge_attention)
topk_j = jax.jit(topk_attention, static_argnames="budget")
quest_j = jax.jit(quest_attention, static_argnames=("page_size", "budget"))
oracle_j = jax.jit(oracle_sampling_attention, static_argnames="budget")
magicpig_j = jax.jit(magicpig_attention, static_argnames="config")
build_j = jax.jit(build_lsh_index, static_argnames="config")
