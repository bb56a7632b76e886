"""Jitted entry points and random inputs shared by the estimator tests.

One compilation per shape is much cheaper than op-by-op eager dispatch on a 2-core
CI machine; the runtime shape checks still run (at trace time).
"""

import jax
import jax.numpy as jnp
import numpy as np

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


def make_qkv(seed, B=2, Hq=4, Hkv=2, N=24, D=16, scale=1.0, cone=0.0, dtype=jnp.float32):
    """Random q, k, v; ``cone`` adds a shared key offset (keys in a narrow cone, as in real models)."""
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, Hq, D)) * scale
    k = rng.normal(size=(B, Hkv, N, D)) * scale + cone * rng.normal(size=(B, Hkv, 1, D))
    v = rng.normal(size=(B, Hkv, N, D))
    return tuple(jnp.asarray(x, dtype) for x in (q, k, v))


def i32(x):
    """An int32 JAX array of ``x``."""
    return jnp.asarray(np.asarray(x), jnp.int32)
