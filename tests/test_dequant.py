"""The pure-JAX dequantization of GGUF rows (magicpig_jax.models.dequant) is bit-equal to
gguf-py's, for every type the model holds as rows; the model's JAX path (other backends, no
extension) equals the float32 product."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from magicpig_jax.io.gguf_blocks import QUANT_TYPES
from magicpig_jax.models import linear as linear_mod
from magicpig_jax.models.dequant import dequantize
from tests._gguf_rows import random_rows, reference

TYPES = sorted(QUANT_TYPES)
_dequant = jax.jit(dequantize, static_argnums=1)


@settings(max_examples=50, deadline=None)
@given(qtype=st.sampled_from(TYPES), rows=st.integers(1, 7), blocks=st.integers(1, 3), special=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_bit_equal_to_gguf(qtype, rows, blocks, special, seed):
    rng = np.random.default_rng(seed)
    n_in = blocks * max(QUANT_TYPES[qtype][2], 32)
    w = random_rows(rng, qtype, rows, n_in, special=special)
    want = np.asarray(gguf.quants.dequantize(w, gguf.GGMLQuantizationType[qtype]), np.float32)
    got = np.asarray(_dequant(jnp.asarray(w.reshape(rows, 1, -1)), qtype)).reshape(rows, n_in)  # leading dims
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_bad_input():
    with pytest.raises(ValueError, match="qtype must be one of"):
        dequantize(jnp.zeros((2, 18), jnp.uint8), "IQ4_NL")
    with pytest.raises(ValueError, match="multiple of 210 bytes"):
        dequantize(jnp.zeros((2, 200), jnp.uint8), "Q6_K")
    with pytest.raises(TypeError, match="uint8"):
        dequantize(jnp.zeros((2, 18), jnp.int8), "Q4_0")


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "Q5_0", "BF16"])
def test_the_jax_path_of_packed_matmul(monkeypatch, qtype):
    """Without the extension (or on another backend) packed_matmul dequantizes in JAX."""
    monkeypatch.setattr(linear_mod, "_host_available", lambda: False)
    rng = np.random.default_rng(5)
    w = random_rows(rng, qtype, 24, 256)
    for m in (1, 20):
        x = rng.standard_normal((m, 256)).astype(np.float32)
        fn = jax.jit(lambda x, w: linear_mod.packed_matmul(x, w, qtype))
        assert "magicpig" not in fn.lower(x, w).as_text()
        ref, bound = reference(x, w, qtype)
        assert np.all(np.abs(np.asarray(fn(x, w)) - ref) <= bound)
