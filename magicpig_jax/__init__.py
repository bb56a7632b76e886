"""magicpig_jax: MagicPIG LSH-sampled attention for long-context decoding, in JAX.

Chen et al., "MagicPIG: LSH Sampling for Efficient LLM Generation", ICLR 2025,
arXiv 2410.16179.

The method (``magicpig_jax.lsh``, ``magicpig_jax.attention``) is pure JAX;
``load_model`` and ``generate`` run it inside a Flax NNX Llama.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load_model", "generate", "__version__"]


def load_model(path=None):
    """Load a model (None = the embedded SmolLM2-135M-Instruct); see :func:`magicpig_jax.io.loader.load_model`."""
    from magicpig_jax.io.loader import load_model as _load

    return _load(path)


def generate(model, prompt, **kwargs):
    """Generate a reply; see :func:`magicpig_jax.generation.generate`."""
    from magicpig_jax.generation import generate as _generate

    return _generate(model, prompt, **kwargs)
