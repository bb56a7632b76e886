"""The GGUF-row products and dequantization (magicpig_jax.host.matvec, models.linear) against
float64 NumPy of gguf-py's own dequantization, for every type the model holds as rows, and the
packed model against the float32 one."""

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
from magicpig_jax.host.matvec import dequantize_rows
from magicpig_jax.io.embedded import embedded_model_path
from magicpig_jax.io.loader import load_model
from magicpig_jax.models import linear as linear_mod
from magicpig_jax.models.linear import MATVEC_MAX_TOKENS, Linear
from tests._gguf_rows import F16_AT, SPECIAL_F16, gguf_type, random_rows, reference

IMPLS = ["scalar", "avx2"] if host.has_avx2() else ["scalar"]
# "auto" also runs the AVX-512VL build of the token-blocked kernels where the CPU has it.
BATCH_IMPLS = [*IMPLS, "auto"] if host.has_avx2() else IMPLS
TYPES = sorted(QUANT_TYPES)
_matvec = jax.jit(quant_matvec, static_argnames=("qtype", "impl", "max_threads"))
_dequant = jax.jit(dequantize_rows, static_argnames=("qtype", "impl", "max_threads"))

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
    deq = np.asarray(_dequant(jnp.asarray(blocks[:64]), qtype=qtype))
    np.testing.assert_array_equal(deq, gguf.quants.dequantize(blocks[:64], gguf_type(qtype)))


@settings(max_examples=min(80, settings.default.max_examples), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    qtype=st.sampled_from(TYPES),
    rows=st.integers(1, 13),  # the AVX2 Q4_1 kernel takes 4 rows at a time: remainders too
    blocks=st.integers(1, 5),
    m=st.integers(1, 20),  # token rows: one, a few, past a token block (8) and past MATVEC_MAX_TOKENS
    impl=st.sampled_from(BATCH_IMPLS),
    special=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_rows_property(qtype, rows, blocks, m, impl, special, seed):
    """Every type, both kernels: random valid rows (normal or special scales) and activations of
    very different magnitudes; the product is within float32 summation error of gguf-py's."""
    rng = np.random.default_rng(seed)
    bw = QUANT_TYPES[qtype][2]
    n_in = blocks * max(bw, 32) + (rng.integers(0, 9) if bw == 1 else 0)  # F16/BF16: any length
    w = random_rows(rng, qtype, rows, n_in, special=special)
    x = (rng.standard_normal((m, n_in)) * rng.choice([1e-3, 1.0, 1e3])).astype(np.float32)
    y = np.asarray(_matvec(jnp.asarray(x), jnp.asarray(w), qtype=qtype, impl=impl))
    ref, bound = reference(x, w, qtype)
    assert np.all(np.isfinite(y)) and np.all(np.abs(y - ref) <= bound)


@settings(max_examples=min(40, settings.default.max_examples), deadline=None)
@given(qtype=st.sampled_from(TYPES), m=st.sampled_from([2, 3, 8, 9, 16, 17]), rows=st.integers(1, 6),
       impl=st.sampled_from(BATCH_IMPLS), seed=st.integers(0, 2**31 - 1))
def test_a_batch_row_is_bit_equal_to_the_token_alone(qtype, m, rows, impl, seed):
    """A batch of token rows (the token-blocked kernels past one token) gives each row exactly
    the bits of that token multiplied alone: a batched decode row does not depend on the others."""
    rng = np.random.default_rng(seed)
    n_in = 2 * max(QUANT_TYPES[qtype][2], 32)
    w = jnp.asarray(random_rows(rng, qtype, rows, n_in))
    x = rng.standard_normal((m, n_in)).astype(np.float32)
    batch = np.asarray(_matvec(jnp.asarray(x), w, qtype=qtype, impl=impl))
    alone = np.concatenate([np.asarray(_matvec(jnp.asarray(x[t:t + 1]), w, qtype=qtype, impl=impl))
                            for t in range(m)])
    np.testing.assert_array_equal(batch.view(np.uint32), alone.view(np.uint32))


@settings(max_examples=min(60, settings.default.max_examples), deadline=None)
@given(qtype=st.sampled_from(TYPES), rows=st.integers(1, 9), blocks=st.integers(1, 3), special=st.booleans(),
       impl=st.sampled_from(IMPLS), seed=st.integers(0, 2**31 - 1))
def test_dequantize_rows_is_bit_equal_to_gguf(qtype, rows, blocks, special, impl, seed):
    rng = np.random.default_rng(seed)
    bw = QUANT_TYPES[qtype][2]
    n_in = blocks * max(bw, 32) + (rng.integers(0, 9) if bw == 1 else 0)  # F16/BF16: any length
    w = random_rows(rng, qtype, rows, n_in, special=special)
    got = np.asarray(_dequant(jnp.asarray(w), qtype=qtype, impl=impl))
    want = np.asarray(gguf.quants.dequantize(w, gguf_type(qtype)), np.float32)
    assert got.shape == (rows, n_in)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES)
def test_every_special_scale_in_every_slot(qtype):
    """Each scale slot of a block takes each special value (subnormal, +-0, smallest normal,
    +-65504) while the others stay normal; both kernels agree with the reference."""
    rng = np.random.default_rng(2)
    bw = QUANT_TYPES[qtype][2]
    n_in = 2 * max(bw, 32)
    w = random_rows(rng, qtype, len(SPECIAL_F16), n_in)
    if qtype in F16_AT:
        w = w.reshape(len(SPECIAL_F16), 2, -1)
        for r, value in enumerate(SPECIAL_F16):
            for at in F16_AT[qtype]:
                w[r, r % 2, at:at + 2] = np.array([value], np.float16).view(np.uint8)
        w = w.reshape(len(SPECIAL_F16), -1)
    else:
        w = random_rows(rng, qtype, len(SPECIAL_F16), n_in, special=True)
    x = rng.standard_normal((2, n_in)).astype(np.float32)
    ref, bound = reference(x, w, qtype)
    for impl in IMPLS:
        y = np.asarray(_matvec(jnp.asarray(x), jnp.asarray(w), qtype=qtype, impl=impl))
        assert np.all(np.isfinite(y)) and np.all(np.abs(y - ref) <= bound), impl


def test_leading_dims_threads_and_dtype():
    rng = np.random.default_rng(3)
    for qtype in ("Q4_1", "Q4_K"):
        w = jnp.asarray(random_rows(rng, qtype, 100, 512))
        x = jnp.asarray(rng.standard_normal((2, 3, 512)).astype(np.float32))
        y_all = _matvec(x, w, qtype=qtype)
        y_one = _matvec(x, w, qtype=qtype, max_threads=1)
        assert y_all.shape == (2, 3, 100)
        np.testing.assert_array_equal(np.asarray(y_all), np.asarray(y_one))  # rows are independent of the split
        assert _matvec(x.astype(jnp.bfloat16), w, qtype=qtype).dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(_dequant(w, qtype=qtype)),
                                      np.asarray(_dequant(w, qtype=qtype, max_threads=1)))


def test_bad_input_names_the_parameter():
    x = jnp.ones((1, 64), jnp.float32)
    good = jnp.zeros((4, packed_row_bytes("Q4_1", 64)), jnp.uint8)
    with pytest.raises(ValueError, match="qtype must be one of"):
        quant_matvec(x, good, "Q2_K")
    with pytest.raises(ValueError, match="impl must be one of"):
        quant_matvec(x, good, "Q4_1", impl="neon")
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_matvec(jnp.ones((1, 48)), good, "Q4_1")
    with pytest.raises(ValueError, match="multiple of 256 for Q4_K"):
        quant_matvec(x, good, "Q4_K")
    with pytest.raises(ValueError, match=r"packed must be uint8 \[Out, 40\]"):
        quant_matvec(x, jnp.zeros((4, 34), jnp.uint8), "Q4_1")
    with pytest.raises(TypeError, match="packed must be uint8"):
        quant_matvec(x, good.astype(jnp.int8), "Q4_1")
    with pytest.raises(ValueError, match="max_threads"):
        quant_matvec(x, good, "Q4_1", max_threads=-1)
    with pytest.raises(ValueError, match="max_threads"):
        quant_matvec(x, good, "Q4_1", max_threads=2**63)
    # an int x was cast to float32 and the product back to int (truncated), a complex x lost its
    # imaginary part: both silently
    from magicpig_jax.models.linear import packed_matmul
    for bad in (jnp.ones((1, 64), jnp.int32), jnp.ones((1, 64), jnp.complex64), jnp.ones((1, 64), bool)):
        with pytest.raises(TypeError, match="x must be floating-point"):
            quant_matvec(bad, good, "Q4_1")
        with pytest.raises(TypeError, match="x must be floating-point"):
            packed_matmul(bad, good, "Q4_1")
    with pytest.raises(ValueError, match="multiple of 144 bytes"):
        dequantize_rows(jnp.zeros((2, 100), jnp.uint8), "Q4_K")
    with pytest.raises(ValueError, match="impl must be one of"):
        dequantize_rows(jnp.zeros((2, 144), jnp.uint8), "Q4_K", impl="neon")
    linear = Linear(64, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"blocks must have shape \(4, 40\)"):
        linear.set_packed(np.zeros((4, 68), np.uint8), "Q4_1")
    with pytest.raises(TypeError, match="uint8"):
        linear.set_packed(np.zeros((4, 40), np.int32), "Q4_1")


@pytest.mark.parametrize("mode", ["tiled", "layer"])
@pytest.mark.parametrize("qtype", TYPES)
def test_linear_reads_the_rows_for_decode_and_prefill(monkeypatch, qtype, mode):
    """A Linear holding GGUF rows has no float kernel; decode-sized calls use the matvec, larger
    ones dequantize (a tile or the whole matrix at a time); all equal the reference."""
    monkeypatch.setattr(linear_mod, "PREFILL_MODE", mode)
    monkeypatch.setattr(linear_mod, "PREFILL_TILE_BYTES", 4 * 256 * 20)  # 16 rows per tile (divides 48): 3 tiles
    rng = np.random.default_rng(4)
    n_out, n_in = 48, 256
    w = random_rows(rng, qtype, n_out, n_in)
    lin = Linear(n_in, n_out, rngs=nnx.Rngs(0))
    lin.set_packed(w, qtype)
    assert lin.kernel is None and lin.packed[...].dtype == jnp.uint8
    graphdef, state = nnx.split(lin)

    @jax.jit
    def apply(state, x):
        return nnx.merge(graphdef, state)(x)

    decode_x = jnp.asarray(rng.standard_normal((MATVEC_MAX_TOKENS, n_in)).astype(np.float32))
    prefill_x = jnp.asarray(rng.standard_normal((3, MATVEC_MAX_TOKENS + 1, n_in)).astype(np.float32))
    assert "magicpig_quant_matvec" in apply.lower(state, decode_x).as_text()
    text = apply.lower(state, prefill_x).as_text()
    assert "magicpig_quant_matvec" not in text and "magicpig_dequantize" in text
    for x in (decode_x, prefill_x):
        ref, bound = reference(np.asarray(x).reshape(-1, n_in), w, qtype)
        got = np.asarray(apply(state, x)).reshape(-1, n_out)
        assert np.all(np.abs(got - ref) <= bound)


@pytest.fixture(scope="module")
def models():
    return load_model(), load_model(packed_weights=False)


def test_embedded_model_holds_its_gguf_rows_only(models):
    packed, plain = models
    layer = packed.module.layers[4]
    assert layer.self_attn.qkv_qtype == "Q4_1" and layer.self_attn.qkv_packed[...].shape == (576 + 2 * 192, 360)
    assert layer.mlp.gate_up_qtype == "Q4_1" and layer.mlp.gate_up_packed[...].shape == (2 * 1536, 360)
    assert layer.self_attn.o_proj.qtype == "Q4_1" and layer.mlp.down_proj.packed[...].shape == (576, 960)
    assert packed.module.tied_qtype == "Q8_0" and packed.module.tied_packed[...].shape == (49152, 612)
    # no float copy of any matrix: the parameters are the file's bytes plus the float32 norms
    assert layer.self_attn.q_proj.kernel is None and layer.self_attn.q_proj.packed is None  # in qkv_packed
    assert layer.self_attn.o_proj.kernel is None and packed.module.embed_tokens is None
    leaves = jax.tree.leaves(nnx.state(packed.module))
    float_bytes = sum(x.nbytes for x in leaves if x.dtype == jnp.float32)
    assert float_bytes < 200_000, float_bytes  # 61 norms of 576 and the RoPE frequencies
    assert plain.module.layers[4].self_attn.q_proj.packed is None and plain.module.tied_packed is None
    assert plain.module.layers[4].self_attn.qkv_packed is None and plain.module.layers[4].mlp.gate_up_packed is None


def test_packed_decode_matches_float32_decode(models):
    packed, plain = models
    ids = packed.tokenizer.encode(packed.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three planets of the solar system."}]))
    states = {name: prefill(model, [ids], max_new_tokens=12) for name, model in (("packed", packed), ("plain", plain))}
    # the prefills (GGUF rows dequantized tile by tile vs float32 weights) agree
    np.testing.assert_allclose(np.asarray(states["packed"].last_logits), np.asarray(states["plain"].last_logits),
                               atol=2e-3, rtol=0)
    logits = {}
    for name, model in (("packed", packed), ("plain", plain)):
        steps = []
        tokens, _ = forced_decode(model, states["packed"], attention="dense", max_new_tokens=12, stop_on_eos=False,
                                  logits_callback=lambda step, lg, steps=steps: steps.append(np.asarray(lg)))
        logits[name] = (tokens, np.stack(steps))
    assert logits["packed"][0] == logits["plain"][0]
    diff = np.abs(logits["packed"][1] - logits["plain"][1]).max()
    assert diff < 2e-3, f"max |dlogit| = {diff:.2e}"


def test_tiles_divide_the_matrix_and_bound_the_temporaries(monkeypatch):
    """Prefill tiles cover the matrix exactly (no sliced copy of it) and the compiled program's
    temporaries are those of a tile, not of the float32 matrix, also for several layers."""
    assert linear_mod._tile_rows(4096, 14336, 8 << 20) == 128  # Llama-3.1-8B's down projection
    assert linear_mod._tile_rows(128256, 4096, 8 << 20) == 384  # its vocabulary (334 tiles)
    assert linear_mod._tile_rows(50, 256, 4 * 256 * 16) == 0  # no multiple of 8 divides 50
    monkeypatch.setattr(linear_mod, "PREFILL_MODE", "tiled")
    monkeypatch.setattr(linear_mod, "PREFILL_TILE_BYTES", 4 * 1024 * 32)  # 32 rows per tile
    rng = np.random.default_rng(6)
    layers = [jnp.asarray(random_rows(rng, "Q8_0", 1024, 1024)) for _ in range(4)]  # 4 MB of float32 each
    x = jnp.asarray(rng.standard_normal((64, 1024)).astype(np.float32))

    def net(x, ws):
        for w in ws:
            x = jnp.tanh(linear_mod.packed_matmul(x, w, "Q8_0"))
        return x

    temp = jax.jit(net).lower(x, layers).compile().memory_analysis().temp_size_in_bytes
    assert temp < 2 << 20, temp  # tiles of 128 KB and activations of 256 KB; one layer's matrix is 4 MB


def test_block_size_helpers_take_numpy_integers_and_refuse_bools_scalars_and_unhashable_types():
    """np.int64(64) was refused as 'not a positive multiple of 32' (it is one), True was taken as 1, a
    0-d array raised IndexError in the JAX dequantization, and a list qtype raised 'unhashable type'."""
    from magicpig_jax.io.gguf_blocks import row_weights
    from magicpig_jax.models.dequant import dequantize

    assert packed_row_bytes("Q4_0", np.int64(64)) == packed_row_bytes("Q4_0", 64) == 36
    assert row_weights("Q4_0", np.int32(36)) == 64 and type(row_weights("Q4_0", np.int32(36))) is int
    for bad in (True, np.bool_(True), 64.0):
        with pytest.raises(ValueError, match="in_features must be a positive multiple"):
            packed_row_bytes("F16", bad)
    with pytest.raises(ValueError, match="qtype must be one of"):
        packed_row_bytes(["Q4_0"], 64)
    with pytest.raises(ValueError, match="packed must have a last axis"):
        dequantize(jnp.asarray(np.uint8(3)), "Q8_0")
