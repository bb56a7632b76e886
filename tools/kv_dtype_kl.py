"""KL of a bfloat16 KV cache from the float32 one, over the likelihood task (teacher-forced prose).

  python tools/kv_dtype_kl.py --lengths 2048 4096 --samples 2 --forced 128 --json runs/kv_dtype_kl.json

For each sample (:func:`magicpig_jax.eval.likelihood.make_likelihood_sample`: real prose,
the last ``--forced`` tokens teacher-forced) the prefix is prefilled with each cache dtype,
then every method decodes the forced tokens from each; the figure is ``KL(p_float32 ||
p_bfloat16)`` per token for the same method (natural log), and for the sparse methods their
KL from float32 dense attention with each cache dtype (what the cache's rounding adds to the
method's own error). The cache's bytes halve with bfloat16.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--forced", type=int, default=128)
    p.add_argument("--methods", nargs="+", default=["dense", "magicpig"])
    p.add_argument("--haystack", default="jargon")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from magicpig_jax.eval.forcing import forced_decode
    from magicpig_jax.eval.likelihood import LogitsRecorder, compare_to_dense, make_likelihood_sample
    from magicpig_jax.generation import prefill
    from magicpig_jax.io.loader import load_model

    model = load_model(args.model)
    rows = []
    for length in args.lengths:
        for index in range(args.samples):
            sample = make_likelihood_sample(model.tokenizer.encode, length, index, haystack=args.haystack,
                                            forced=args.forced)
            logp = {}
            for dtype in ("float32", "bfloat16"):
                state = prefill(model, [sample.prefix], args.forced + 1,
                                cache_dtype=jnp.float32 if dtype == "float32" else jnp.bfloat16)
                for method in args.methods:
                    rec = LogitsRecorder(args.forced)
                    forced_decode(model, state, forced_tokens=[sample.targets], logits_callback=rec,
                                  attention=method, max_new_tokens=args.forced, stop_on_eos=False)
                    logp[dtype, method] = rec.logp
                del state
            for method in args.methods:
                r = compare_to_dense(logp["bfloat16", method], logp["float32", method], sample.targets)
                row = {"length": length, "index": index, "method": method, "kl_bf16_from_f32": r["kl"],
                       "kl_max": r["kl_max"], "top1_agree": r["top1"], "nll_bf16": r["nll"],
                       "nll_f32": compare_to_dense(logp["float32", method], logp["float32", method],
                                                   sample.targets)["nll"]}
                if method != "dense" and ("float32", "dense") in logp:
                    for dtype in ("float32", "bfloat16"):  # the method's divergence from float32 dense
                        row[f"kl_method_{dtype}_from_dense_f32"] = compare_to_dense(
                            logp[dtype, method], logp["float32", "dense"], sample.targets)["kl"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    summary = {}
    for method in args.methods:
        sel = [r for r in rows if r["method"] == method]
        summary[method] = {"mean_kl_bf16_from_f32": float(np.mean([r["kl_bf16_from_f32"] for r in sel])),
                           "max_kl": float(np.max([r["kl_max"] for r in sel])),
                           "mean_top1_agree": float(np.mean([r["top1_agree"] for r in sel]))}
        if method != "dense" and "dense" in args.methods:  # the divergence from dense needs dense's run
            for dtype in ("float32", "bfloat16"):
                key = f"kl_method_{dtype}_from_dense_f32"
                summary[method][f"mean_{key}"] = float(np.mean([r[key] for r in sel]))
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows,
                                         "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
