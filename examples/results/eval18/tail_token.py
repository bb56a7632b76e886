"""Where MagicPIG's KL tail comes from: eval18's worst token, layer by layer.

Document 8 of the 8K likelihood task (licenses-heldout, seed 0, 128 teacher-forced tokens) has one
token at a KL of about 5 nats from dense under MagicPIG (10, 150) with layers 0 and 15 dense. This
script prefills the document once, finds that token, prints what dense and MagicPIG predict there,
then makes one more layer dense at a time and records the KL at that token and over the document.
MagicPIG's sampled set is a function of the keys and the seeded hyperplanes, so every run is
deterministic.

Run: python examples/results/eval18/tail_token.py OUT.json [--num-local 64]
"""
import argparse
import json
import time

import numpy as np

from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.eval.forcing import forced_decode
from magicpig_jax.eval.likelihood import LogitsRecorder, make_likelihood_sample
from magicpig_jax.generation import Sampling, decode_spec, prefill
from magicpig_jax.io.loader import load_model

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--num-local", type=int, default=64)
p.add_argument("--index", type=int, default=8)
args = p.parse_args()

model = load_model()
n = 128
lik = make_likelihood_sample(model.tokenizer.encode, 8192, args.index, seed=0, haystack="licenses-heldout", forced=n)
state = prefill(model, [lik.prefix], n - 1)
cfg = MagicPIGConfig(K=10, L=150, num_local=args.num_local)


def run(attention, dense_layers=None):
    rec = LogitsRecorder(n)
    spec = decode_spec(model, attention, cfg if attention != "dense" else None, dense_layers)
    forced_decode(model, state, spec=spec, max_new_tokens=n, sampling=Sampling(seed=0), forced_tokens=[lik.targets],
                  logits_callback=rec, stop_on_eos=False)
    return rec.logp.astype(np.float64)


def kl(lp, lq):  # KL(p || q) per position, natural log
    return (np.exp(lp) * (lp - lq)).sum(-1)


t0 = time.time()
ld = run("dense")
base = (0, 15)
lm = run("magicpig", base)
k = kl(ld, lm)
t = int(np.argmax(k))
tok = model.tokenizer.decode


def top(lp, m=3):
    idx = np.argsort(-lp[t])[:m]
    return [(tok([int(i)]), round(float(np.exp(lp[t, i])), 3)) for i in idx]


ctx = lik.prefix + lik.targets[:t]
out = {"index": args.index, "num_local": args.num_local, "token_position": len(lik.prefix) + t, "step": t,
       "context_tail": tok(ctx[-40:]), "target": tok([lik.targets[t]]), "kl_at_token": float(k[t]),
       "kl_mean": float(k.mean()), "dense_top3": top(ld), "magicpig_top3": top(lm), "one_more_dense_layer": []}
print(json.dumps({x: out[x] for x in out if x != "one_more_dense_layer"}, indent=1), flush=True)
for layer in range(model.config.num_layers):
    if layer in base:
        continue
    kk = kl(ld, run("magicpig", (*base, layer)))
    out["one_more_dense_layer"].append({"layer": layer, "kl_at_token": float(kk[t]), "kl_mean": float(kk.mean())})
    print(layer, round(float(kk[t]), 3), round(float(kk.mean()), 4), flush=True)
out["seconds"] = time.time() - t0
with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
