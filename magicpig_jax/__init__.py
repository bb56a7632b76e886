"""magicpig_jax: MagicPIG LSH-sampled attention for long-context decoding, in JAX.

Chen et al., "MagicPIG: LSH Sampling for Efficient LLM Generation", ICLR 2025,
arXiv 2410.16179.

The method (``magicpig_jax.lsh``, ``magicpig_jax.attention``) is pure JAX;
``load_model`` and ``generate`` run it inside a Flax NNX Llama.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load_model", "generate", "__version__"]


def __getattr__(name: str):
    """``load_model`` and ``generate`` are the real functions, imported on first access.

    Importing them lazily keeps ``import magicpig_jax.lsh`` free of Flax and the loaders, while
    ``help(magicpig_jax.generate)`` and ``inspect.signature`` show the real signature.
    """
    if name == "load_model":
        from magicpig_jax.io.loader import load_model

        return load_model
    if name == "generate":
        from magicpig_jax.generation import generate

        return generate
    raise AttributeError(f"module 'magicpig_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
