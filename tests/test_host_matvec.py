"""The quantized decode matvec (magicpig_jax.host.matvec, models.linear) against float64
NumPy of gguf-py's own dequantization, and the packed model against the float32 one."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from magicpig_jax import host
from magicpig_jax.eval.forcing import forced_decode
from magicpig_jax.generation import prefill
from magicpig_jax.host import QUANT_TYPES, packed_row_bytes, quant_matvec
from magicpig_jax.io.embedded import embedded_model_path
from magicpig_jax.io.loader import load_model
from magicpig_jax.models.linear import MATVEC_MAX_TOKENS, Linear

IMPLS = ["scalar", "avx2"] if host.has_avx2() else ["scalar"]
_matvec = jax.jit(quant_matvec, static_argnames=("qtype", "impl", "max_threads"))


def reference(x: np.ndarray, blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``x @ W.T`` with W from gguf.quants.dequantize, and the float32 error bound
    ``n * eps * (|x| @ |W|.T)`` of any summation order (plus a subnormal floor)."""
    w = np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]), np.float64)
    x64 = np.asarray(x, np.float64)
    bound = x.shape[-1] * np.finfo(np.float32).eps * (np.abs(x64) @ np.abs(w).T) + 1e-30
    return x64 @ w.T, bound


def random_blocks(rng: np.random.Generator, rows: int, nb: int, qtype: str, scale: float = 0.02) -> np.ndarray:
    """Random GGUF blocks with finite f16 scales (and mins for Q4_1)."""
    bb = QUANT_TYPES[qtype][1]
    blocks = rng.integers(0, 256, (rows, nb, bb), dtype=np.uint8)
    halves = 2 if qtype == "Q4_1" else 1
    f16 = (rng.standard_normal((rows, nb, halves)) * scale).astype(np.float16)
    blocks[:, :, : 2 * halves] = f16.view(np.uint8).reshape(rows, nb, 2 * halves)
    return blocks.reshape(rows, nb * bb)


@pytest.fixture(scope="module")
def gguf_tensors():
    reader = gguf.GGUFReader(str(embedded_model_path()))
    return {t.name: (np.asarray(t.data), t.tensor_type.name) for t in reader.tensors}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("name", ["blk.3.attn_k.weight", "blk.7.ffn_down.weight", "token_embd.weight"])
def test_matches_the_dequantized_gguf_tensor(gguf_tensors, name, impl):
    blocks, qtype = gguf_tensors[name]
    assert qtype == ("Q8_0" if name == "token_embd.weight" else "Q4_1")
    n_in = blocks.shape[1] // QUANT_TYPES[qtype][1] * 32
    x = np.random.default_rng(1).standard_normal((3, n_in)).astype(np.float32)
    y = np.asarray(_matvec(jnp.asarray(x), jnp.asarray(blocks), qtype=qtype, impl=impl))
    ref, bound = reference(x, blocks, qtype)
    assert y.shape == ref.shape and y.dtype == np.float32
    assert np.all(np.abs(y - ref) <= bound)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    qtype=st.sampled_from(sorted(QUANT_TYPES)),
    rows=st.integers(1, 13),  # the AVX2 Q4_1 kernel takes 4 rows at a time: remainders too
    nb=st.integers(1, 19),
    m=st.integers(1, 3),
    impl=st.sampled_from(IMPLS),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_blocks_property(qtype, rows, nb, m, impl, seed):
    rng = np.random.default_rng(seed)
    blocks = random_blocks(rng, rows, nb, qtype)
    x = (rng.standard_normal((m, nb * 32)) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
    y = np.asarray(_matvec(jnp.asarray(x), jnp.asarray(blocks), qtype=qtype, impl=impl))
    ref, bound = reference(x, blocks, qtype)
    assert np.all(np.abs(y - ref) <= bound)


@pytest.mark.parametrize("qtype", sorted(QUANT_TYPES))
def test_subnormal_and_zero_scales(qtype):
    rng = np.random.default_rng(2)
    blocks = random_blocks(rng, 6, 2, qtype).reshape(6, 2, -1)
    halves = 2 if qtype == "Q4_1" else 1
    special = np.array([6e-8, -3e-6, 0.0, -0.0, 6.1e-5, 65504.0], np.float16)  # subnormal, zero, extremes
    for r in range(6):
        scales = np.array([special[r], special[(r + 1) % 6]][:halves], np.float16)
        blocks[r, :, : 2 * halves] = scales.view(np.uint8)
    blocks = blocks.reshape(6, -1)
    x = rng.standard_normal((1, 64)).astype(np.float32)
    for impl in IMPLS:
        y = np.asarray(_matvec(jnp.asarray(x), jnp.asarray(blocks), qtype=qtype, impl=impl))
        ref, bound = reference(x, blocks, qtype)
        assert np.all(np.isfinite(y)) and np.all(np.abs(y - ref) <= bound)


def test_leading_dims_threads_and_dtype():
    rng = np.random.default_rng(3)
    blocks = jnp.asarray(random_blocks(rng, 100, 4, "Q4_1"))
    x = jnp.asarray(rng.standard_normal((2, 3, 128)).astype(np.float32))
    y_all = _matvec(x, blocks, qtype="Q4_1")
    y_one = _matvec(x, blocks, qtype="Q4_1", max_threads=1)
    assert y_all.shape == (2, 3, 100)
    np.testing.assert_array_equal(np.asarray(y_all), np.asarray(y_one))  # rows are independent of the split
    y16 = _matvec(x.astype(jnp.bfloat16), blocks, qtype="Q4_1")
    assert y16.dtype == jnp.bfloat16


def test_bad_input_names_the_parameter():
    x = jnp.ones((1, 64), jnp.float32)
    good = jnp.zeros((4, packed_row_bytes("Q4_1", 64)), jnp.uint8)
    with pytest.raises(ValueError, match="qtype must be one of"):
        quant_matvec(x, good, "Q4_0")
    with pytest.raises(ValueError, match="impl must be one of"):
        quant_matvec(x, good, "Q4_1", impl="neon")
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_matvec(jnp.ones((1, 48)), good, "Q4_1")
    with pytest.raises(ValueError, match=r"packed must be uint8 \[Out, 40\]"):
        quant_matvec(x, jnp.zeros((4, 34), jnp.uint8), "Q4_1")
    with pytest.raises(TypeError, match="packed must be uint8"):
        quant_matvec(x, good.astype(jnp.int8), "Q4_1")
    with pytest.raises(ValueError, match="max_threads"):
        quant_matvec(x, good, "Q4_1", max_threads=-1)
    linear = Linear(64, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"blocks must have shape \(4, 40\)"):
        linear.set_packed(np.zeros((4, 68), np.uint8), "Q4_1")
    with pytest.raises(TypeError, match="uint8"):
        linear.set_packed(np.zeros((4, 40), np.int32), "Q4_1")


@pytest.mark.parametrize("qtype", sorted(QUANT_TYPES))
def test_linear_uses_the_blocks_for_decode_rows_only(qtype):
    rng = np.random.default_rng(4)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype])
    w_deq = np.asarray(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[qtype]), np.float32)
    linear = Linear(96, 48, rngs=nnx.Rngs(0))
    linear.kernel.set_value(jnp.asarray(w_deq.T))
    linear.set_packed(blocks, qtype)
    graphdef, state = nnx.split(linear)

    @jax.jit
    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    decode_x = jnp.asarray(rng.standard_normal((MATVEC_MAX_TOKENS, 96)).astype(np.float32))
    prefill_x = jnp.asarray(rng.standard_normal((MATVEC_MAX_TOKENS + 1, 96)).astype(np.float32))
    assert "magicpig_quant_matvec" in apply.lower(state, decode_x).as_text()
    assert "magicpig_quant_matvec" not in apply.lower(state, prefill_x).as_text()
    for x in (decode_x, prefill_x):
        ref, bound = reference(np.asarray(x), blocks, qtype)
        assert np.all(np.abs(np.asarray(apply(state, x)) - ref) <= bound)


@pytest.fixture(scope="module")
def models():
    return load_model(), load_model(packed_weights=False)


def test_embedded_model_keeps_its_gguf_blocks(models):
    packed, plain = models
    layer = packed.module.layers[4]
    assert layer.self_attn.qkv_qtype == "Q4_1" and layer.self_attn.qkv_packed[...].shape == (576 + 2 * 192, 360)
    assert layer.mlp.gate_up_qtype == "Q4_1" and layer.mlp.gate_up_packed[...].shape == (2 * 1536, 360)
    assert layer.self_attn.o_proj.qtype == "Q4_1" and layer.mlp.down_proj.packed[...].shape == (576, 960)
    assert layer.self_attn.q_proj.packed is None  # its rows live in qkv_packed
    assert packed.module.tied_qtype == "Q8_0" and packed.module.tied_packed[...].shape == (49152, 612)
    assert plain.module.layers[4].self_attn.q_proj.packed is None and plain.module.tied_packed is None
    assert plain.module.layers[4].self_attn.qkv_packed is None and plain.module.layers[4].mlp.gate_up_packed is None


def test_packed_decode_matches_float32_decode(models):
    packed, plain = models
    ids = packed.tokenizer.encode(packed.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three planets of the solar system."}]))
    state = prefill(packed, [ids], max_new_tokens=12)
    logits = {}
    for name, model in (("packed", packed), ("plain", plain)):
        steps = []
        tokens, _ = forced_decode(model, state, attention="dense", max_new_tokens=12, stop_on_eos=False,
                                  logits_callback=lambda step, lg, steps=steps: steps.append(np.asarray(lg)))
        logits[name] = (tokens, np.stack(steps))
    assert logits["packed"][0] == logits["plain"][0]
    diff = np.abs(logits["packed"][1] - logits["plain"][1]).max()
    assert diff < 2e-3, f"max |dlogit| = {diff:.2e}"
