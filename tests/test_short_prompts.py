"""Prompts shorter than ``num_sink``: the sinks are the first ``num_sink`` positions of the
context even when the decoder writes some of them.

Found by a review: the host TopK and Quest ops attended the sinks ``[0, num_sink)`` while the
context was shorter, i.e. cache slots not yet written (a 2-token prompt with ``budget=1.0``
decoded other tokens than dense attention), and the host MagicPIG index, built from the range
``[length, length)``, hashed the generated tokens at positions ``[length, num_sink)`` once they
were appended. The pure-JAX paths (which do not append) are checked alike.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from magicpig_jax.attention import MagicPIGConfig
from magicpig_jax.decode_loop import DecodeHooks, Sampling, start_decode
from magicpig_jax.generation import decode_spec, prefill
from tests._tiny import tiny_model

CFG = MagicPIGConfig(num_sink=4, num_local=4)
STEPS = 30  # with a generation buffer of 8 the first append is due at 4 + 4 + 2 * 8 = 24 positions


def _run(model, rows, attention, budget=None, **changes):
    """The run, its spec and its logits, float32 ``[steps, B, V]``."""
    spec = decode_spec(model, attention, CFG, None, budget, 16, positions=STEPS + 8)
    spec = dataclasses.replace(spec, generation_buffer=8, **changes)
    logits = []
    run = start_decode(model, prefill(model, rows, STEPS), spec, STEPS, Sampling(), stop_on_eos=False,
                       hooks=DecodeHooks(on_logits=lambda t, x: logits.append(np.asarray(x))))
    for _ in run:
        pass
    return run, spec, np.stack(logits)


@pytest.fixture(scope="module")
def model():
    return tiny_model(0)  # the bugs are the decoders', not a model's: the 3-layer model compiles fast


@pytest.fixture(scope="module")
def rows():
    return [[5], [5, 17], [5, 17, 29], [5, 17, 29, 41, 53, 65]]


@pytest.fixture(scope="module")
def dense_run(model, rows):
    return _run(model, rows, "dense")


@pytest.mark.parametrize("attention,host", [("topk", True), ("quest", True), ("topk", False), ("quest", False)])
def test_every_key_budget_decodes_as_dense(model, rows, dense_run, attention, host):
    # budget 1.0 keeps every key of the range: a position attended twice or not at all shows in the logits
    (run, _, logits), (dense, _, dense_logits) = _run(model, rows, attention, 1.0, host=host), dense_run
    np.testing.assert_allclose(logits, dense_logits, atol=1e-4, rtol=0)
    assert run.outputs == dense.outputs


def test_host_index_never_hashes_a_sink(model, rows):
    run, spec, _ = _run(model, rows, "magicpig")
    (layer,) = spec.sparse_layers(model.config.num_layers)  # layers 0 and 1 are dense by default
    bounds = np.asarray(run.indices[layer].bounds)
    assert (bounds[:, 0] == CFG.num_sink).all(), bounds.tolist()  # start: num_sink for every row
    assert (bounds[:, 1] > CFG.num_sink).all(), bounds.tolist()  # and the appends took place
