"""Transitional alias of :mod:`magicpig_jax.host.exact` (``magicpig_jax.models.decoding`` imports
``host_exact_attention`` from here until it switches to ``magicpig_jax.host``); new code imports
``from magicpig_jax.host import host_exact_attention``."""

from magicpig_jax.host.exact import MAX_GROUP, host_exact_attention

__all__ = ["MAX_GROUP", "host_exact_attention"]
