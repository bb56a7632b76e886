"""A jitted index build hashes the centered keys it stores the mean of; oracle sampling of a head
with no finite logit draws nothing; arguments that are not arrays are named."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from magicpig_jax.attention import oracle_sampling_attention


def test_a_jitted_build_hashes_the_keys_centered_by_its_own_mean():
    """Keys c + a, c, c - a, c + 2a, c - 2a: the second's centered key is at float32 rounding level.
    Inside a jitted build XLA recomputed the mean in the hashing fusion, so the codes were of
    another vector than the one u is computed from (a biased normalizer under jit: 42 of these 60
    draws). XLA's fusions need its default optimization level, which the suite lowers
    (tests/_xla.py): run in a fresh interpreter with the default flags."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import jax, jax.numpy as jnp, numpy as np
        from magicpig_jax import lsh
        from magicpig_jax.attention import MagicPIGConfig, build_lsh_index
        D, K, L = 3, 2, 3
        c, a = np.array([0.3, -1.0, 2.0]), np.array([1.0, 0.5, -0.2])
        k = jnp.asarray(np.stack([c + a, c, c - a, c + 2 * a, c - 2 * a]).astype(np.float32)[None, None])
        cfg = MagicPIGConfig(K=K, L=L, num_sink=0, num_local=0)
        build = jax.jit(build_lsh_index, static_argnums=2)
        bad = 0
        for key in jax.random.split(jax.random.key(1), 60):
            projections = lsh.simhash_projections(key, D, K, L)
            index = build(k, projections, cfg)
            eager = lsh.simhash_codes(k - index.mean[:, :, None, :], projections, K, L)
            bad += int((np.asarray(index.codes) != np.asarray(eager)).any())
        print(bad)
    """)
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert out.split() == ["0"]


def test_oracle_sampling_of_a_head_without_a_finite_logit_draws_nothing():
    """Every valid logit of KV head 0 is -inf: its weights are all 0 and the inverse CDF landed on
    position N - 1, past the row's length (padding's V came out). Now it draws nothing, and the head
    is NaN, as a softmax over only -inf logits is (a -inf in every key is corrupt input); its lse is -inf."""
    q = np.array([[[1.0, 0.5], [1.0, 0.5]]], np.float32)
    k = np.ones((1, 2, 6, 2), np.float32)
    k[0, 0, :, 0] = -np.inf
    v = np.arange(24, dtype=np.float32).reshape(1, 2, 6, 2)
    v[0, :, 4:] = np.nan  # padding past length 4
    out, lse, distinct = oracle_sampling_attention(jax.random.key(0), jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                                   3, jnp.asarray([4]))
    assert np.isnan(np.asarray(out)[0, 0]).all() and float(lse[0, 0]) == -np.inf and int(distinct[0, 0]) == 0
    assert np.isfinite(np.asarray(out)[0, 1]).all() and int(distinct[0, 1]) >= 1  # the other head draws


def test_the_argument_checks_without_the_type_hook():
    """Arguments that are not arrays, a 0-d out, a 0-d or integer x: named. Run in a fresh interpreter,
    without the suite's jaxtyping hook (which checks annotated arguments first), as a user runs it."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import jax.numpy as jnp, numpy as np
        from magicpig_jax import lsh
        from magicpig_jax.attention import MagicPIGConfig, build_lsh_index, merge_attention
        cfg = MagicPIGConfig(K=2, L=4, num_sink=0, num_local=0)
        k, p = jnp.zeros((1, 1, 4, 2)), jnp.ones((2, 8))
        calls = [lambda: build_lsh_index(np.asarray(k).tolist(), p, cfg),
                 lambda: build_lsh_index(k, np.asarray(p).tolist(), cfg),
                 lambda: merge_attention([1.0], 0.0, [1.0], 0.0),
                 lambda: merge_attention(jnp.float32(1), jnp.float32(0), jnp.float32(1), jnp.float32(0)),
                 lambda: lsh.simhash_codes(np.float32(1), p, 2, 4),
                 lambda: lsh.simhash_codes(np.ones((3, 2), np.int32), p, 2, 4)]
        for call in calls:
            try:
                call()
                print("no error")
            except (TypeError, ValueError) as err:
                print(type(err).__name__, str(err).split(";")[0])
    """)
    lines = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines == ["TypeError k must be an array (jax or NumPy), got list",
                     "TypeError projections must be an array (jax or NumPy), got list",
                     "TypeError merge_attention: out_a must be an array (jax or NumPy), got list",
                     "ValueError merge_attention needs out_a/out_b of shape [..., D] and lse_a/lse_b of shape [...]",
                     "TypeError x must be a float array [..., D] (vectors to hash), got float32 of shape ()",
                     "TypeError x must be a float array [..., D] (vectors to hash), got int32 of shape (3, 2)"]
