"""The decoder's layers of one structure share one traced program per half of the block.

:meth:`DecoderLayer.attention_inputs` and :meth:`DecoderLayer.after_attention` are jitted
functions of the layer's graph definition (static) and state: tracing a model traces them once
per distinct layer structure, not once per layer (the traces were most of a process's time before
its first token). Checked on the jaxpr; that the shared programs compute what the layer's
methods compute called directly; and that a change of the settings the blocks read while tracing
(``models.linear.PREFILL_MODE``) traces them again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from magicpig_jax.models.config import LlamaConfig
from magicpig_jax.models.llama import Llama


def _model(**overrides):
    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=64, **overrides)
    return Llama(config, nnx.Rngs(0))


def _attend(i, q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def _forward(model, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return model.forward(tokens, positions, lambda i, k, v: (k, v), _attend)


def _block_calls(model, tokens) -> dict[str, list]:
    """The inner jaxprs of the block programs called by one forward, by name."""
    graphdef, state = nnx.split(model)
    jaxpr = jax.make_jaxpr(lambda s, t: _forward(nnx.merge(graphdef, s), t))(state, tokens)
    calls: dict[str, list] = {}
    for eqn in jaxpr.jaxpr.eqns:
        if eqn.primitive.name in ("pjit", "jit"):
            calls.setdefault(eqn.params["name"], []).append(eqn.params["jaxpr"])
    return calls


def test_layers_of_one_structure_share_one_trace():
    tokens = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6) % 40)
    calls = _block_calls(_model(), tokens)
    assert len(calls["_block_qkv"]) == len(calls["_block_residual"]) == 4  # one call per layer
    for name in ("_block_qkv", "_block_residual"):
        assert all(j is calls[name][0] for j in calls[name]), name  # one traced program


def test_a_layer_of_another_structure_gets_its_own_trace():
    # SmolLM3's NoPE layers (no rotary embedding: a static attribute) differ from the others
    tokens = jnp.asarray(np.arange(12, dtype=np.int32).reshape(2, 6) % 40)
    calls = _block_calls(_model(nope_layers=(3,)), tokens)
    for name in ("_block_qkv", "_block_residual"):  # keyed by the whole layer's graph definition
        traced = calls[name]
        assert traced[0] is traced[1] is traced[2] and traced[3] is not traced[0], name


def test_shared_programs_compute_the_layers_methods():
    model = _model(nope_layers=(1,))
    tokens = jnp.asarray(np.arange(14, dtype=np.int32).reshape(2, 7) * 3 % 40)
    positions = jnp.broadcast_to(jnp.arange(7, dtype=jnp.int32), tokens.shape)
    x = model.embed(tokens)
    inv_freq = model.rope(positions)
    want = x
    for layer in model.layers:  # the methods themselves, eagerly
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(want), positions, inv_freq)
        o = _attend(0, q, k, v)
        want = layer.add_mlp(layer.add_attention(want, o.reshape(*o.shape[:2], -1)))
    np.testing.assert_allclose(np.asarray(_forward(model, tokens)), np.asarray(model.norm(want)), rtol=1e-5,
                               atol=1e-5)


def test_a_changed_prefill_setting_traces_again():
    # packed_matmul reads models.linear's PREFILL_MODE / PREFILL_TILE_BYTES while tracing: a program traced
    # after a change must follow it, not reuse the blocks traced under the old value
    from magicpig_jax.models import linear
    from tests._gguf_rows import random_rows

    config = LlamaConfig(vocab_size=40, hidden_size=256, intermediate_size=256, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=64, max_position_embeddings=64)
    model = Llama(config, nnx.Rngs(1))
    rng = np.random.default_rng(0)
    for layer in model.layers:
        layer.mlp.down_proj.set_packed(random_rows(rng, "Q8_0", 256, 256), "Q8_0")
    graphdef, state = nnx.split(model)
    tokens = jnp.zeros((1, 32), jnp.int32)

    def dequantize_calls():
        program = jax.jit(lambda s: _forward(nnx.merge(graphdef, s), tokens))
        return program.lower(state).as_text().count("magicpig_dequantize")

    saved = linear.PREFILL_MODE, linear.PREFILL_TILE_BYTES
    try:
        linear.PREFILL_MODE, linear.PREFILL_TILE_BYTES = "tiled", 4 * 256 * 32  # 32 rows a tile: 8 tiles a matrix
        tiled = dequantize_calls()
        linear.PREFILL_MODE = "layer"  # the whole matrix at once
        layer = dequantize_calls()
    finally:
        linear.PREFILL_MODE, linear.PREFILL_TILE_BYTES = saved
    # the lowered text holds the layers' one shared function: 8 tiles, then one whole-matrix dequantization
    assert (tiled, layer) == (8, 1)
