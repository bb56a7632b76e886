"""magicpig_jax.models.decoding: the exported decode steps never write past the cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.generation import forward_logits, prefill
from magicpig_jax.models.decoding import DecodeSpec, build_indices, compiled_decode_step, decode_step
from tests._tiny import tiny_model

SPECS = [DecodeSpec("dense"), DecodeSpec("magicpig", MagicPIGConfig(K=3, L=6, num_sink=4, num_local=16), ())]


@pytest.fixture(scope="module")
def model():
    return tiny_model(5)


def _full(model, spec):
    """A 250-token prefill (capacity 256) decoded greedily to a full cache: (cache, indices, tokens, ids)."""
    prompt = np.random.default_rng(1).integers(0, 97, 250).tolist()
    state = prefill(model, [prompt], 4)
    cache = state.cache.copy()
    assert cache.capacity == 256
    graphdef, params = nnx.split(model.module)
    indices = build_indices(cache, spec, model.config.num_layers)
    tokens = jnp.argmax(state.last_logits, -1).astype(jnp.int32)
    ids = prompt + [int(tokens[0])]
    for _ in range(6):  # positions 250 .. 255
        tokens, logits, _, cache, indices = decode_step(graphdef, params, cache, indices, tokens, jax.random.key(0),
                                                        jnp.float32(0), jnp.float32(1), spec=spec)
        ids.append(int(tokens[0]))
    assert int(cache.lengths[0]) == 256
    if spec.backend == "dense":  # the last step wrote position 255 and its logits are the full forward's
        np.testing.assert_allclose(np.asarray(logits[0]), forward_logits(model, ids[:-1])[-1], rtol=0, atol=1e-4)
    return graphdef, params, cache, indices, tokens, ids


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.backend)
def test_decode_step_refuses_a_full_cache(model, spec):
    graphdef, params, cache, indices, tokens, _ = _full(model, spec)
    with pytest.raises(ValueError, match=r"past the cache: row\(s\) \[0\] hold \[256\] tokens, the capacity is 256"):
        decode_step(graphdef, params, cache, indices, tokens, jax.random.key(0), jnp.float32(0), jnp.float32(1),
                    spec=spec)
    assert int(cache.lengths[0]) == 256  # refused before anything was donated
    leaves, treedef = jax.tree.flatten(params)
    step = compiled_decode_step(graphdef, treedef, spec)
    with pytest.raises(ValueError, match="past the cache"):
        step(leaves, cache, indices, tokens, jax.random.key(0), np.int32(7), jnp.float32(0), jnp.float32(1))
    assert int(cache.lengths[0]) == 256


def test_traced_step_leaves_a_full_row_unchanged(model):
    # Inside a trace the lengths are not concrete: the step itself writes nothing for the full row
    # and keeps its length (no write clamped into slot 255), and its logits are still exact.
    spec = SPECS[0]
    graphdef, params, cache, indices, tokens, ids = _full(model, spec)
    k_before = [np.asarray(x) for x in cache.k]
    v_before = [np.asarray(x) for x in cache.v]

    @jax.jit
    def traced(params, cache, indices, tokens):
        return decode_step(graphdef, params, cache, indices, tokens, jax.random.key(0), jnp.float32(0),
                           jnp.float32(1), spec=spec)

    _, logits, _, cache2, _ = traced(params, cache, indices, tokens)
    assert int(cache2.lengths[0]) == 256
    for before, after in zip(k_before + v_before, list(cache2.k) + list(cache2.v), strict=True):
        np.testing.assert_array_equal(np.asarray(after), before)
    np.testing.assert_allclose(np.asarray(logits[0]), forward_logits(model, ids)[-1], rtol=0, atol=1e-4)
