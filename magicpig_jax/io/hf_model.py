"""Read a Hugging Face Llama directory: ``config.json`` + ``*.safetensors``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from magicpig_jax.models.config import LlamaConfig

__all__ = ["read_hf_dir"]


def read_hf_dir(folder: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """Parse a Hugging Face model directory of a Llama-family model.

    Weights are read with ``safetensors`` (any float dtype, converted to
    float32) in the Hugging Face naming and ``(out, in)`` layout.

    Returns:
      ``(config, weights)``.

    Raises:
      FileNotFoundError: ``config.json`` or the ``*.safetensors`` files are missing.
      ValueError: the model type is not Llama-family.
    """
    from safetensors import safe_open

    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: a Hugging Face model directory needs config.json")
    config = LlamaConfig.from_hf_config(json.loads(cfg_path.read_text()))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {folder}")
    weights = {}
    for file in files:
        with safe_open(str(file), framework="flax") as f:
            for name in f.keys():
                weights[name] = np.asarray(f.get_tensor(name), dtype=np.float32)
    return config, weights
