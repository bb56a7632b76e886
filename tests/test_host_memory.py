"""A long decode through the host path does not leak: RSS stays flat after warm-up."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.generation import decode, prefill
from tests._tiny import TINY, tiny_model


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_5000_host_decode_steps_keep_resident_memory_flat():
    # a context of 8192 positions: decode stops a row at the model's context (400 + 5000 > 4096)
    model = tiny_model(11, dataclasses.replace(TINY, max_position_embeddings=8192))
    prompt = np.random.default_rng(0).integers(0, 97, 400).tolist()
    cfg = MagicPIGConfig(K=4, L=16, num_sink=4, num_local=32)
    state = prefill(model, [prompt], 5000)
    samples: dict[int, int] = {}
    step = [0]

    def progress(n):
        step[0] += n
        if step[0] in (500, 4999):
            samples[step[0]] = _rss_bytes()

    outs, stats = decode(model, state, attention="magicpig", max_new_tokens=5000, config=cfg, dense_layers=(),
                         stop_on_eos=False, progress=progress)
    assert len(outs[0]) == 5000
    assert stats["decode_steps"] == 4999
    # generated tokens past the 256-token buffer were appended to the index (sampling continues)
    assert 0 < stats["sampled_fraction"] < 1
    growth = (samples[4999] - samples[500]) / samples[500]
    assert growth < 0.01, f"RSS grew {100 * growth:.2f}% from step 500 to 4999"
