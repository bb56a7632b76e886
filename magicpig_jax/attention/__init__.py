"""Attention estimators for one decode step: dense, MagicPIG, baselines, and the exact LSE merge.

Shape glossary: B batch, Hq query heads, Hkv KV heads, G = Hq / Hkv, N cached
keys, D head dim. Query head h reads KV head ``h // G``. The attention functions are pure
and jit-able (configs are static Python objects); the cost model's (:func:`expected_sampled_fraction`,
:func:`tables_for_fraction`) are host NumPy functions of Python numbers.

Padding is inert: a key past its row's length, or one an estimator does not use (not
sampled, not kept, never drawn), is selected out of the logits and of the values, so
whatever its V row holds (NaN, inf, garbage) the result is the one of a clean cache, and so
is whatever its K row holds past the row's length. A non-finite K row inside a row's length
is not inert where the estimator reads every key of its range: MagicPIG and the hybrid
center the keys by their mean (a NaN or infinite key gives the heads of its KV head NaN),
TopK, Quest and oracle sampling score every key (a NaN or +inf logit gives NaN). A NaN query
gives its head NaN in every estimator; an infinite one gives NaN wherever a logit is NaN or
+inf, and in MagicPIG and the hybrid always (its SimHash codes are undefined). A head whose
logits are all -inf (a -inf in q against keys of one sign there) gives ``out`` NaN and ``lse``
-inf, never an empty-looking row (out 0): its partition function is 0, so
:func:`merge_attention` gives it weight 0 beside a part with finite logits (as one softmax over
the union gives those keys) and keeps it NaN beside empty parts.

The inertness is the forward pass's. The functions are differentiable (``jax.grad`` of dense
attention and of MagicPIG, for a fixed sampled set, matches finite differences; a zero query, a
zero centered key or a cosine of ±1 gives a finite gradient, the angle's kink taken as slope 0),
but the gradient with respect to ``q`` multiplies every
K row by its logit's zero cotangent, so a NaN or infinite K row past a row's length makes it
NaN: zero the padding of a cache you differentiate through.
"""

from magicpig_jax.attention.baselines import (
    budget_tokens,
    oracle_sampling_attention,
    quest_attention,
    topk_attention,
)
from magicpig_jax.attention.config import GENERATION_BUFFER, MagicPIGConfig
from magicpig_jax.attention.cost_model import expected_sampled_fraction, tables_for_fraction
from magicpig_jax.attention.dense import dense_attention
from magicpig_jax.attention.hybrid import HybridConfig, hybrid_attention
from magicpig_jax.attention.layer_configs import LayerConfigs
from magicpig_jax.attention.magicpig import LSHIndex, build_lsh_index, magicpig_attention
from magicpig_jax.attention.merge import merge_attention
from magicpig_jax.attention.static import static_attention

__all__ = [
    "MagicPIGConfig",
    "GENERATION_BUFFER",
    "dense_attention",
    "merge_attention",
    "static_attention",
    "LSHIndex",
    "build_lsh_index",
    "magicpig_attention",
    "HybridConfig",
    "hybrid_attention",
    "LayerConfigs",
    "topk_attention",
    "quest_attention",
    "oracle_sampling_attention",
    "budget_tokens",
    "expected_sampled_fraction",
    "tables_for_fraction",
]
