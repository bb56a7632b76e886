"""Does truncating MagicPIG's importance weights help at eval18's worst token? (a floor on u)

Prefills document 8 of the 8K likelihood task up to the input token of tail_token.py's worst step,
then for every sparse layer compares the pure-JAX reference's output with dense attention (mean
relative error over the 9 query heads) with ``log u`` floored at log(f) for several f, by setting
``magicpig_jax.attention.magicpig.LOG_U_FLOOR`` (the reference runs eagerly, so the module constant
is read at each call). The default floor is 1e-30. Prints one line per layer.

Run: python examples/results/eval18/u_floor.py > u_floor_doc8.txt
"""
import json
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

import magicpig_jax.attention.magicpig as mpmod
from magicpig_jax.attention import MagicPIGConfig, build_lsh_index, dense_attention, magicpig_attention
from magicpig_jax.eval.likelihood import make_likelihood_sample
from magicpig_jax.generation import prefill
from magicpig_jax.io.loader import load_model
from magicpig_jax.models.backends.spec import layer_projections
from magicpig_jax.models.decoding import decode_queries

tail = json.load(open('examples/results/eval18/tail_token_doc8.json'))
model = load_model()
lik = make_likelihood_sample(model.tokenizer.encode, 8192, 8, seed=0, haystack="licenses-heldout", forced=128)
t = tail["step"]
ids = lik.prefix + lik.targets[: t - 1]
state = prefill(model, [ids], 1)
graphdef, params = nnx.split(model.module)
Q = np.asarray(decode_queries(graphdef, params, state.cache, jnp.asarray([lik.targets[t - 1]], jnp.int32)), np.float32)
N = len(ids)
cfg = MagicPIGConfig(K=10, L=150)
for layer in range(30):
    if layer in (0, 15):
        continue
    qj = jnp.asarray(Q[layer, 0])[None]
    kj = jnp.asarray(np.asarray(state.cache.k[layer][0, :, :N], np.float32))[None]
    vj = jnp.asarray(np.asarray(state.cache.v[layer][0, :, :N], np.float32))[None]
    od = np.asarray(dense_attention(qj, kj, vj)[0])[0]
    index = build_lsh_index(kj, layer_projections(cfg, layer, 64), cfg)
    row = []
    for fl in (1e-30, 1e-6, 1e-4, 1e-3, 1e-2, 3e-2, 1e-1):
        mpmod.LOG_U_FLOOR = math.log(fl)
        om = np.asarray(magicpig_attention(qj, kj, vj, index, cfg)[0])[0]
        err = np.linalg.norm(om - od, axis=-1) / np.linalg.norm(od, axis=-1)
        row.append(float(np.mean(err)))
    print(layer, [round(x, 3) for x in row], flush=True)
