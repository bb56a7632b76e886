"""Sampled content digests: name a multi-GB model by its sizes and evenly spaced pieces of its bytes.

A full SHA-1 of an 8B model's weights takes tens of seconds; a different model, quantization or
fine-tune differs in any piece of its tensors, so a few MiB of evenly spaced pieces tell them apart
in well under a second. This is an identity check (which model wrote these records), not an
integrity check: a change confined to bytes between the pieces goes unseen.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path

import numpy as np

__all__ = ["array_digest", "file_digest", "sampled_pieces", "weights_identity"]


def sampled_pieces(size: int, chunks: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of ``chunks`` evenly spaced pieces of ``chunk_bytes`` over ``size`` bytes
    (first and last included), or the whole range when it is no longer than the pieces together.

    Raises:
      ValueError: ``chunks`` or ``chunk_bytes`` below 1, or ``size`` negative.
    """
    if chunks < 1 or chunk_bytes < 1 or size < 0:
        raise ValueError(f"chunks and chunk_bytes must be >= 1 and size >= 0, got {chunks}, {chunk_bytes}, {size}")
    if size <= chunks * chunk_bytes:
        return [(0, size)]
    return [(i * (size - chunk_bytes) // max(chunks - 1, 1), chunk_bytes) for i in range(chunks)]


def file_digest(h, path: Path, name: str, chunks: int = 64, chunk_bytes: int = 1 << 16) -> None:
    """Feed ``name``, the size of the file ``path`` and its sampled pieces to the hash object ``h``."""
    size = path.stat().st_size
    h.update(f"{name}\0{size}\0".encode())
    with open(path, "rb") as f:
        for offset, length in sampled_pieces(size, chunks, chunk_bytes):
            f.seek(offset)
            h.update(f.read(length))


def array_digest(arrays: Mapping[str, np.ndarray], chunks: int = 64, chunk_bytes: int = 1 << 12) -> str:
    """SHA-1 (12 hex digits) of named arrays: each name, dtype, shape and sampled pieces of its bytes.

    Args:
      arrays: name -> array of any dtype and shape (NumPy, or anything ``np.asarray`` takes).
      chunks, chunk_bytes: pieces per array (see :func:`sampled_pieces`).

    Returns:
      12 lowercase hex digits; the same for equal arrays under the same names, whatever their order.
    """
    h = hashlib.sha1()
    for name in sorted(arrays):
        a = np.ascontiguousarray(np.asarray(arrays[name]))
        buf = a.reshape(-1).view(np.uint8)
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        for offset, length in sampled_pieces(buf.size, chunks, chunk_bytes):
            h.update(buf[offset:offset + length].tobytes())
    return h.hexdigest()[:12]


def weights_identity(source) -> str:
    """SHA-1 (12 hex digits) naming a model's weights wherever its files lie and whatever they are named.

    A checkpoint (``magicpig-jax convert``) is named by the ``weights_sha1`` its
    ``magicpig_model.json`` records (orbax's files differ between two saves of the same arrays); a
    GGUF file by its size and sampled pieces, without its name (a renamed copy or a symlink is the
    same model); a Hugging Face directory by the files its loader reads, each by its path inside
    the directory. Unlike eval's ``model_sha1`` (:func:`magicpig_jax.eval.settings.model_digest`),
    a single file's name does not count.

    Args:
      source: a model path as :func:`magicpig_jax.io.loader.load_model` takes (not None).

    Raises:
      OSError: a file cannot be read; FileNotFoundError, ValueError: as the loader, for a path
        that is no model.
    """
    import json
    import os

    from magicpig_jax.io.checkpoint import MARKER, is_checkpoint
    from magicpig_jax.io.loader import model_files

    root = Path(source)
    if is_checkpoint(root):
        recorded = json.loads((root / MARKER).read_text()).get("weights_sha1")
        if isinstance(recorded, str):
            return recorded
    h = hashlib.sha1()
    for path in model_files(root):
        file_digest(h, path, os.path.relpath(path, root) if root.is_dir() else "", 64, 1 << 16)
    return h.hexdigest()[:12]
