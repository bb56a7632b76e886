"""The host ops refuse an index whose bounds disagree with its tables (edited by hand, or rolled
back after appends), instead of writing past a chunk or taking a position twice; the op-only
wrapper names an index that is not a HostIndex or does not fit the cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magicpig_jax import host
from magicpig_jax.attention import MagicPIGConfig, build_lsh_index
from magicpig_jax.lsh import simhash_codes


def _setup(B=1, Hq=2, Hkv=1, N=100, D=8, K=3, L=4):
    cfg = MagicPIGConfig(K=K, L=L, num_sink=2, num_local=3)
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, Hq, D), np.float32))
    k = jnp.asarray(rng.standard_normal((B, Hkv, N, D), np.float32) + np.float32(0.5))
    v = jnp.asarray(rng.standard_normal((B, Hkv, N, D), np.float32))
    proj = jnp.asarray(rng.standard_normal((D, K * L), np.float32))
    return cfg, q, k, v, proj


def test_append_refuses_bounds_that_disagree_with_the_chunks():
    cfg, q, k, v, proj = _setup()
    index = host.host_build_index(k, proj, cfg, jnp.asarray([100], jnp.int32), capacity=100, chunk_size=50,
                                  open_capacity=4)
    assert np.asarray(index.bounds).tolist() == [[2, 97, 97]]
    # sealed = end = 50 while chunk 1 holds 47 positions: merging 4 more would write them past its count
    bad = dataclasses.replace(index, bounds=jnp.asarray([[2, 50, 50]], jnp.int32))
    with pytest.raises(Exception, match="the index's chunk 1 holds 47 positions in table 0 where its bounds say 0: "
                                        r"bounds edited apart from the tables \(rebuild the index\)"):
        jax.block_until_ready(host.host_append(bad, k[:, :, 50:70]).bounds)


def test_append_refuses_a_rolled_back_index_and_appends_once_otherwise():
    """Bounds restored after appends that merged into a chunk: re-appending the same keys would put
    each position in the tables twice (counted as two collisions from one table). Refused; the
    appends on the index as built give the sampled set of the codes counted in NumPy."""
    cfg, q, k, v, proj = _setup()
    built = host.host_build_index(k, proj, cfg, jnp.asarray([60], jnp.int32), capacity=100, chunk_size=50,
                                  open_capacity=4)
    assert np.asarray(built.bounds).tolist() == [[2, 57, 57]]
    grown = host.host_append(built, k[:, :, 57:67])  # two merges of the 4-key open chunk
    assert np.asarray(grown.bounds).tolist() == [[2, 67, 65]]
    rolled = dataclasses.replace(grown, bounds=built.bounds)
    with pytest.raises(Exception, match="the index's chunk 1 holds 15 positions in table 0 where its bounds say 7"):
        jax.block_until_ready(host.host_append(rolled, k[:, :, 57:67]).bounds)
    q_codes = simhash_codes(q, proj, cfg.K, cfg.L)
    mask = host.host_sampled_attention(q, q_codes, k, v, grown, jnp.asarray([70], jnp.int32), window=3,
                                       return_mask=True)[3]
    # the keys' codes after centering by the index's mean; sampled: equal codes in >= 2 of the L tables
    k_codes = np.asarray(simhash_codes(k - grown.mean[:, :, None, :], proj, cfg.K, cfg.L))
    hits = (k_codes[0, 0][None] == np.asarray(q_codes)[0][:, None, :]).sum(-1)  # [Hq, N]
    expected = np.zeros((2, 100), bool)
    expected[:, 2:67] = hits[:, 2:67] >= 2
    np.testing.assert_array_equal(np.asarray(mask)[0], expected)


def test_sampled_attention_names_an_index_that_does_not_fit():
    cfg, q, k, v, proj = _setup(B=2, Hkv=2, N=40)
    lengths = jnp.asarray([40, 40], jnp.int32)
    q_codes = simhash_codes(q, proj, cfg.K, cfg.L)
    with pytest.raises(TypeError, match="index must be a HostIndex .* got LSHIndex"):
        host.host_sampled_attention(q, q_codes, k, v, build_lsh_index(k, proj, cfg, lengths), lengths)
    one_head = host.host_build_index(k[:, :1], proj, cfg, lengths)
    with pytest.raises(ValueError, match=r"index.ids must be uint16 \[2, 2, "):
        host.host_sampled_attention(q, q_codes, k, v, one_head, lengths)
