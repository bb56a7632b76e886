"""The table of decode backends and :func:`backend_for`, the one place that chooses an entry."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from magicpig_jax.attention import (
    MagicPIGConfig,
)
from magicpig_jax.attention.layer_configs import LayerConfigs
from magicpig_jax.models.backends import host as _h
from magicpig_jax.models.backends import pure as _p
from magicpig_jax.models.backends.spec import LAYERED, Backend, DecodeSpec, _no_sparse_layer

__all__ = ["LayerState", "backend_for", "check_layers", "per_layer"]

# ------------------------------------------------------------------------------------------
# Per-layer configurations (LayerConfigs): each layer's state carries its own config.
# ------------------------------------------------------------------------------------------


def check_layers(spec: DecodeSpec) -> None:
    """Refuse a :class:`DecodeSpec` whose per-layer configs (``spec.layers``) cannot run as given.

    Raises:
      TypeError: ``spec.layers`` is not a :class:`LayerConfigs`.
      ValueError: a backend without per-layer configs, offload or a mesh, ``dense_layers`` other
        than the configs' dense layers, or ``spec.magicpig`` other than their ``base()``.
    """
    layers = spec.layers
    if not isinstance(layers, LayerConfigs):
        raise TypeError(f"layers must be a LayerConfigs, got {type(layers).__name__}")
    if spec.backend not in LAYERED:
        raise ValueError(f"per-layer configs run with the backends {LAYERED}, got backend={spec.backend!r}")
    if spec.offload or spec.mesh is not None:
        raise ValueError("per-layer configs are not supported with offload or a mesh")
    if tuple(sorted(spec.dense_layers)) != layers.dense_layers:
        raise ValueError(f"dense_layers {tuple(spec.dense_layers)} must be the layer configs' dense layers "
                         f"{layers.dense_layers}")
    if spec.magicpig != layers.base():
        raise ValueError("magicpig must be the layer configs' base() config")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerState:
    """A sparse layer's decode state and its own configuration (static), under :class:`LayerConfigs`."""

    state: Any
    config: MagicPIGConfig = dataclasses.field(metadata=dict(static=True))


@functools.cache
def per_layer(base: Backend) -> Backend:
    """``base`` run with each layer's config of :attr:`DecodeSpec.layers` (states wrapped in :class:`LayerState`)."""

    def build(spec, k, lengths, layer, capacity):
        config = spec.layers.config(layer)
        return LayerState(base.build(spec.with_config(config), k, lengths, layer, capacity), config)

    def attend(spec, q, k, v, state: LayerState, lengths, key):
        return base.attend(spec.with_config(state.config), q, k, v, state.state, lengths, key)

    def after_step(spec, state: LayerState, k, lengths):
        return LayerState(base.after_step(spec.with_config(state.config), state.state, k, lengths), state.config)

    def validate(spec):
        for i in spec.layers.sparse_layers:
            base.validate(spec.with_config(spec.layers.config(i)))

    return dataclasses.replace(base, name=f"{base.name}, per-layer configs", build=build, attend=attend,
                               after_step=after_step, validate=validate)


# ------------------------------------------------------------------------------------------
# The table.
# ------------------------------------------------------------------------------------------

_TABLE: dict[str, Backend] = {
    "dense": Backend("dense", build=_no_sparse_layer, attend=_no_sparse_layer),
    **_p.ENTRIES,
    **_h.ENTRIES,
}


def backend_for(spec: DecodeSpec) -> Backend:
    """The :class:`Backend` that runs ``spec``: the one place the decoder dispatches on the method."""
    if spec.layers is not None:
        return per_layer(_entry(spec))
    return _entry(spec)


def _entry(spec: DecodeSpec) -> Backend:
    if spec.backend == "magicpig":
        if spec.offload:
            return _TABLE["magicpig-offload"]
        if spec.uses_host:
            return _TABLE["magicpig-host" if spec.mesh is None else "magicpig-host-sharded"]
        return _TABLE["magicpig-ref"]
    if spec.backend in ("dense", "topk", "quest") and spec.uses_host and spec.mesh is None:
        return _TABLE[f"{spec.backend}-host"]
    return _TABLE[spec.backend]

