"""A tiny random Llama (3 layers, Hq=4, Hkv=2) for cache and decoding tests."""

from __future__ import annotations

from pathlib import Path

from flax import nnx
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from magicpig_jax.io.loader import LoadedModel
from magicpig_jax.io.tokenizer import Tokenizer
from magicpig_jax.models.config import LlamaConfig
from magicpig_jax.models.llama import Llama

TINY = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                   num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=4096)


def tiny_model(seed: int = 0, config: LlamaConfig = TINY) -> LoadedModel:
    module = Llama(config, nnx.Rngs(seed))
    tok = Tokenizer(HFTokenizer(models.BPE()), chat_template=None, eos_token_ids=())
    return LoadedModel(module, config, tok, Path("tiny"))
