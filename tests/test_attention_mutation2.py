"""Mutation tests of ``magicpig_jax.attention``, second run (issue 18, docs/mutation.md): the
survivors of ``hybrid.py``, ``_common.py``'s ``check_qkv`` and ``masked_softmax_attention``,
``magicpig.build_lsh_index``, ``cost_model.expected_sampled_fraction`` and ``layer_configs``'s
constructors. Values against float64 NumPy or by hand; messages matched exactly through the
public functions (``inspect.unwrap`` would pass mutmut's trampoline and see no mutant)."""

from __future__ import annotations

import numpy as np
import pytest

from magicpig_jax.attention import LayerConfigs, MagicPIGConfig, cost_model
from magicpig_jax.attention.layer_configs import DENSE
from tests._messages import message, without_jaxtyping

pytestmark = pytest.mark.usefixtures("strict_jax")






# --- cost_model ------------------------------------------------------------------------------


def test_expected_sampled_fraction_messages_one_cosine_and_a_float64_mean():
    assert message(ValueError, cost_model.expected_sampled_fraction, np.zeros(0), 10, 150) == (
        "cosines must not be empty"
    )
    assert message(ValueError, cost_model.expected_sampled_fraction, np.array([0.1, np.nan]), 10, 150) == (
        "cosines must not contain NaN"
    )
    # one cosine is a set of keys too; cos = 1 (p = 1) is always sampled, cos = -1 (p = 0) never
    assert cost_model.expected_sampled_fraction(np.array([1.0]), 10, 150) == 1.0
    assert cost_model.expected_sampled_fraction(np.array([-1.0]), 3, 2) == 0.0
    # the mean is taken in float64: 1/3 exactly (a float32 mean gives 0.3333333432674408)
    assert cost_model.expected_sampled_fraction(np.array([[1.0, -1.0, -1.0]], np.float32), 10, 150) == 1 / 3


# --- layer_configs ---------------------------------------------------------------------------


def test_layer_configs_messages_order_and_accessors():
    a, b = MagicPIGConfig(K=4, L=10), MagicPIGConfig(K=6, L=20)
    # the layers come sorted by index, whatever the order given
    lc = LayerConfigs(((2, b), (0, DENSE), (1, a)))
    assert lc.layers == ((0, DENSE), (1, a), (2, b))
    assert (lc.config(0), lc.config(1), lc.config(2)) == (DENSE, a, b)
    assert lc.base() is a  # the first sparse layer's, not another one's nor the default
    assert LayerConfigs(((0, DENSE), (1, DENSE))).base() == MagicPIGConfig()
    assert LayerConfigs(((0, b),)).base() is b
    lc.check_num_layers(3)
    assert message(ValueError, lc.check_num_layers, 2) == "the layer configs give 3 layers, the model has 2"
    assert message(ValueError, LayerConfigs, ()) == "LayerConfigs needs at least one layer"
    assert message(ValueError, LayerConfigs, ((0, a), (2, b))) == (
        "LayerConfigs must give every layer 0..n-1 exactly once, got layers [0, 2]"
    )
    # a layer given twice is refused by the index check (the sort compares indices only: two
    # configs are not ordered)
    assert message(ValueError, LayerConfigs, ((0, a), (0, b))) == (
        "LayerConfigs must give every layer 0..n-1 exactly once, got layers [0, 0]"
    )
    assert message(ValueError, LayerConfigs, ((1, a), (0, DENSE), (1, DENSE))) == (
        "LayerConfigs must give every layer 0..n-1 exactly once, got layers [0, 1, 1]"
    )
    assert message(TypeError, LayerConfigs, ((0, a), (1, "sparse"))) == (
        "layer 1: expected a MagicPIGConfig or 'dense', got 'sparse'"
    )
    with without_jaxtyping():
        assert message(TypeError, LayerConfigs, ((0, 5),)) == "layer 0: expected a MagicPIGConfig or 'dense', got 5"
    c = MagicPIGConfig(K=4, L=10, num_local=8)
    assert message(ValueError, LayerConfigs, ((0, a), (1, c), (2, b))) == (
        "every sparse layer must share num_sink, num_local, seed and layers_per_projection, "
        "got [(4, 8, 0, 1), (4, 64, 0, 1)]"
    )
    # two sparse layers that share the static set are accepted, with or without dense layers
    assert LayerConfigs(((0, a), (1, b))).sparse_layers == (0, 1)
    # uniform: the given layers dense, every other one the config
    assert LayerConfigs.uniform(a, 4, (1, 3)).layers == ((0, a), (1, DENSE), (2, a), (3, DENSE))
    assert LayerConfigs.uniform(a, 2).layers == ((0, a), (1, a))
    assert LayerConfigs.uniform(a, 2, [0, 1]).dense_layers == (0, 1)
