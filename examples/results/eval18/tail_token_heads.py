"""The attention at eval18's worst token, in the layer whose dense attention removes most of its KL.

Reads tail_token.py's JSON (the document, the step, the per-layer ablation), prefills the document
up to the input token of that step, takes the decode query of every layer (dense attention,
:func:`magicpig_jax.models.decoding.decode_queries`) and, for the chosen layer and each query head,
reports the dense softmax weight of its heaviest key, that key's position, its cosine with the query
after MagicPIG's centering (the hashed range's mean key subtracted, arXiv 2410.16179 Section 4.2)
and its sampling probability u at K = 10, L = 150 (collides in >= 2 tables), in float64 NumPy; then
each head's relative output error against dense attention for MagicPIG (the pure-JAX reference with
the decoder's hyperplanes of that layer) and for TopK over all keys at the same number of keys
(MagicPIG's mean sampled count plus the static set).

Run: python examples/results/eval18/tail_token_heads.py tail_token_doc8.json OUT.json [--layer 7]
"""
import argparse
import json
import math

import jax.numpy as jnp
import numpy as np
from flax import nnx

from magicpig_jax.attention import MagicPIGConfig, build_lsh_index, dense_attention, magicpig_attention
from magicpig_jax.attention.baselines import topk_attention
from magicpig_jax.eval.likelihood import make_likelihood_sample
from magicpig_jax.generation import prefill
from magicpig_jax.io.loader import load_model
from magicpig_jax.models.backends.spec import layer_projections
from magicpig_jax.models.decoding import decode_queries

p = argparse.ArgumentParser()
p.add_argument("tail_json")
p.add_argument("out")
p.add_argument("--layer", type=int, default=None, help="default: the layer whose ablation lowers the KL most")
args = p.parse_args()
tail = json.load(open(args.tail_json))
best = min(tail["one_more_dense_layer"], key=lambda r: r["kl_at_token"])
layer = args.layer if args.layer is not None else best["layer"]
K, L, num_sink, num_local = 10, 150, 4, tail["num_local"]

model = load_model()
lik = make_likelihood_sample(model.tokenizer.encode, 8192, tail["index"], seed=0, haystack="licenses-heldout",
                             forced=128)
t = tail["step"]
ids = lik.prefix + lik.targets[: t - 1]
state = prefill(model, [ids], 1)
graphdef, params = nnx.split(model.module)
q = np.asarray(decode_queries(graphdef, params, state.cache, jnp.asarray([lik.targets[t - 1]], jnp.int32)),
               np.float64)[layer, 0]
N = len(ids)
k = np.asarray(state.cache.k[layer][0, :, :N], np.float64)
Hq, D = q.shape
Hkv = k.shape[0]
G = Hq // Hkv
start, end = min(num_sink, N), max(N - num_local, min(num_sink, N))
mean = k[:, start:end].mean(axis=1)


def u_of(cos):
    P = (1.0 - math.acos(max(-1.0, min(1.0, cos))) / math.pi) ** K
    return 1.0 - (1.0 - P) ** L - L * P * (1.0 - P) ** (L - 1)


heads = []
for h in range(Hq):
    kv = h // G
    logits = k[kv] @ q[h] / math.sqrt(D)
    w = np.exp(logits - logits.max())
    w /= w.sum()
    j = int(np.argmax(w))
    kc = k[kv, j] - mean[kv]
    cos = float(q[h] @ kc / (np.linalg.norm(q[h]) * np.linalg.norm(kc)))
    top5 = np.sort(w)[::-1][:5]
    heads.append({"head": h, "top_key_position": j, "top_key_weight": float(w[j]), "top5_weight": float(top5.sum()),
                  "in_hashed_range": bool(start <= j < end), "centered_cosine": cos, "u": u_of(cos),
                  "context_at_key": model.tokenizer.decode(ids[max(0, j - 6): j + 1])})
    print(heads[-1], flush=True)

cfg = MagicPIGConfig(K=K, L=L, num_sink=num_sink, num_local=num_local)
qj = jnp.asarray(q, jnp.float32)[None]
kj = jnp.asarray(k, jnp.float32)[None]
vj = jnp.asarray(np.asarray(state.cache.v[layer][0, :, :N], np.float32))[None]
od, _ = dense_attention(qj, kj, vj)
index = build_lsh_index(kj, layer_projections(cfg, layer, D), cfg)
om, _, ns = magicpig_attention(qj, kj, vj, index, cfg)
budget = int(round(float(np.mean(np.asarray(ns))))) + num_sink + num_local
ot, _ = topk_attention(qj, kj, vj, budget)
od, om, ot, ns = (np.asarray(x, np.float64)[0] for x in (od, om, ot, ns))
for h, rec in enumerate(heads):
    nd = np.linalg.norm(od[h])
    rec.update(sampled=int(ns[h]), magicpig_rel_error=float(np.linalg.norm(om[h] - od[h]) / nd),
               topk_rel_error=float(np.linalg.norm(ot[h] - od[h]) / nd))
    print(h, rec["sampled"], round(rec["magicpig_rel_error"], 3), round(rec["topk_rel_error"], 3), flush=True)
out = {"topk_budget": budget, "layer": layer, "step": t, "N": N, "K": K, "L": L, "heads": heads}
json.dump(out, open(args.out, "w"), indent=1)
