"""magicpig_jax.host.build: the index keeps its keys centered when the prefill hashed nothing.

After a prompt no longer than num_sink + num_local the hashed range is empty and its mean is 0.
The first append into such a row sets its mean from the keys it appends (then those and every
later key are hashed centered); a row that already hashes keys keeps its mean.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from magicpig_jax import host, lsh
from magicpig_jax.attention import LSHIndex, MagicPIGConfig, magicpig_attention
from magicpig_jax.attention.magicpig import sampled_mask_and_log_u
from magicpig_jax.generation import prefill
from magicpig_jax.models.decoding import DecodeSpec, build_indices, decode_step
from tests._tiny import tiny_model

B, HQ, HKV, N, D = 2, 4, 2, 120, 16
CFG = MagicPIGConfig(K=3, L=8, num_sink=4, num_local=10)


def _data(seed=0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, HQ, D)).astype(np.float32)
    # keys in a cone (a common offset per KV head): uncentered codes would all look alike
    k = (rng.normal(size=(B, HKV, N, D)) + 4.0 * rng.normal(size=(1, HKV, 1, D))).astype(np.float32)
    v = rng.normal(size=(B, HKV, N, D)).astype(np.float32)
    proj = rng.normal(size=(D, CFG.K * CFG.L)).astype(np.float32)
    return q, k, v, proj


def test_first_append_into_an_empty_range_sets_the_mean():
    q, k, v, proj = _data()
    built = np.array([12, 60])  # row 0: 12 <= 4 + 10, nothing hashed; row 1: [4, 50) hashed
    hidx = host.host_build_index(jnp.asarray(k), jnp.asarray(proj), CFG, jnp.asarray(built, jnp.int32), capacity=N)
    np.testing.assert_array_equal(np.asarray(hidx.bounds[:, :2]), [[4, 4], [4, 50]])
    np.testing.assert_array_equal(np.asarray(hidx.mean[0]), 0.0)
    mean1 = k[1, :, 4:50].astype(np.float64).mean(1)
    np.testing.assert_allclose(np.asarray(hidx.mean[1]), mean1, rtol=0, atol=1e-5)
    # Append 20 keys to row 0 (positions 4..23) and 15 to row 1 (50..64); the new keys' rows past
    # the counts hold NaN (selected out of the mean).
    counts = np.array([20, 15])
    k_new = np.stack([k[0, :, 4:24], k[1, :, 50:70]])
    k_new[1, :, 15:] = np.nan
    hidx = host.host_append(hidx, jnp.asarray(k_new), jnp.asarray(counts, jnp.int32))
    mean0 = k[0, :, 4:24].astype(np.float64).mean(1)  # float64 reference of the first append's mean
    np.testing.assert_allclose(np.asarray(hidx.mean[0]), mean0, rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(hidx.mean[1]), mean1, rtol=0, atol=1e-5)  # kept
    assert np.abs(mean0).max() > 1.0  # the cone: centering matters
    # A second append into row 0 keeps its mean.
    hidx = host.host_append(hidx, jnp.asarray(np.stack([k[0, :, 24:34], k[1, :, 65:75]])), jnp.asarray([10, 0]))
    np.testing.assert_allclose(np.asarray(hidx.mean[0]), mean0, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(hidx.bounds[:, :2]), [[4, 34], [4, 65]])
    # The sampled attention equals the pure-JAX reference on the same hashed ranges, centered by
    # these means, with every key's code computed by the library (float32) from k - mean.
    lengths = jnp.asarray([60, 90], jnp.int32)
    mean = hidx.mean
    codes = lsh.simhash_codes(jnp.asarray(k) - mean[:, :, None, :], jnp.asarray(proj), CFG.K, CFG.L)
    ref = LSHIndex(codes=codes, mean=mean, start=hidx.start, end=hidx.end, projections=jnp.asarray(proj))
    out, lse, ns, mask = host.host_magicpig_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), hidx, CFG,
                                                      lengths, return_mask=True)
    out_r, lse_r, ns_r = magicpig_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), ref, CFG, lengths)
    sampled, _, _ = sampled_mask_and_log_u(jnp.asarray(q), jnp.asarray(k), ref, CFG, lengths)
    np.testing.assert_array_equal(np.asarray(mask), np.asarray(sampled).reshape(B, HQ, N))
    np.testing.assert_array_equal(np.asarray(ns), np.asarray(ns_r))
    assert 0 < int(np.asarray(ns)[0].sum()) < HQ * 30  # row 0 samples some, not all, of its 30 keys
    np.testing.assert_allclose(np.asarray(out), np.asarray(out_r), rtol=0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_r), rtol=0, atol=1e-5)


def test_decoder_centers_generated_tokens_after_a_short_prompt():
    # A 12-token prompt with 4 sinks and 16 local keys hashes nothing; with a generation buffer of
    # 8 the first append (positions 4..11) is due once 16 + 2 * 8 positions are unhashed. Each
    # sparse layer's mean is then the float64 mean of those 8 cached keys.
    model = tiny_model(3)
    cfg = MagicPIGConfig(K=3, L=8, num_sink=4, num_local=16)
    spec = DecodeSpec("magicpig", cfg, (), generation_buffer=8, host=True)
    prompt = np.random.default_rng(2).integers(0, 97, 12).tolist()
    state = prefill(model, [prompt], 40)
    cache = state.cache.copy()
    graphdef, params = nnx.split(model.module)
    indices = build_indices(cache, spec, model.config.num_layers)
    for index in indices:
        np.testing.assert_array_equal(np.asarray(index.bounds[:, :2]), [[4, 4]])
        np.testing.assert_array_equal(np.asarray(index.mean), 0.0)
    tokens = jnp.argmax(state.last_logits, -1).astype(jnp.int32)
    for _ in range(24):  # lengths 13 .. 36: the append is due at 36 - 4 >= 32
        tokens, _, _, cache, indices = decode_step(graphdef, params, cache, indices, tokens, jax.random.key(0),
                                                   jnp.float32(0), jnp.float32(1), spec=spec)
    assert int(cache.lengths[0]) == 36
    for layer, index in enumerate(indices):
        np.testing.assert_array_equal(np.asarray(index.bounds[:, :2]), [[4, 12]])
        expect = np.asarray(cache.k[layer], np.float64)[:, :, 4:12].mean(2)
        np.testing.assert_allclose(np.asarray(index.mean), expect, rtol=0, atol=1e-5)
        assert np.abs(expect).max() > 1e-2


def test_first_mean_keeps_rows_that_hash_or_append_nothing():
    q, k, v, proj = _data(1)
    hidx = host.host_build_index(jnp.asarray(k), jnp.asarray(proj), CFG, jnp.asarray([10, 80], jnp.int32))
    new = host.build.first_mean(hidx, jnp.asarray(k[:, :, :5]), jnp.asarray([0, 5], jnp.int32))
    np.testing.assert_array_equal(np.asarray(new.mean), np.asarray(hidx.mean))  # row 0: count 0; row 1: not empty
    assert all(getattr(new, f) is getattr(hidx, f) for f in ("ids", "offsets", "open_codes", "bounds", "projections"))
