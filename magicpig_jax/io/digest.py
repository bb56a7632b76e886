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

__all__ = ["array_digest", "array_checksum", "file_digest", "sampled_pieces", "weights_identity"]


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
    _region_digest(h, path, name, 0, chunks, chunk_bytes)


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


def array_checksum(arrays: Mapping[str, np.ndarray]) -> str:
    """CRC-32 (8 hex digits) of named arrays: each name, dtype, shape and every byte.

    The integrity check of a checkpoint's weights (:mod:`magicpig_jax.io.checkpoint`), where
    :func:`array_digest`, which samples pieces, misses a byte changed between them. CRC-32 (zlib,
    as zip and PNG use it) catches any burst of up to 32 flipped bits and other damage but with
    probability ``2**-32``; it reads several GB/s, a fraction of the time restoring the arrays takes.

    Args:
      arrays: name -> array of any dtype and shape (NumPy, or anything ``np.asarray`` takes).

    Returns:
      8 lowercase hex digits; the same for equal arrays under the same names, whatever their order.
    """
    import zlib

    crc = 0
    for name in sorted(arrays):
        a = np.ascontiguousarray(np.asarray(arrays[name]))
        crc = zlib.crc32(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode(), crc)
        crc = zlib.crc32(memoryview(a.reshape(-1).view(np.uint8)), crc)
    return f"{crc:08x}"


def weights_identity(source) -> str:
    """SHA-1 (12 hex digits) naming a model's weights, whatever the files around them say.

    A checkpoint (``magicpig-jax convert``) is named by the ``weights_sha1`` its
    ``magicpig_model.json`` records (orbax's files differ between two saves of the same arrays); a
    GGUF file by the size and sampled pieces of its tensor data (its header, which holds the chat
    template and other metadata, and its name left out: a renamed copy or a symlink is the same
    model); a Hugging Face directory by the tensor data of its safetensors files (after each
    file's JSON header), each by its name inside the directory (config, tokenizer and template
    files left out). Unlike eval's ``model_sha1`` (:func:`magicpig_jax.eval.settings.model_digest`),
    which names everything the loader reads, it changes only with the weights.

    Args:
      source: a model path (a GGUF file, a Hugging Face directory, a checkpoint directory).

    Raises:
      OSError: a file cannot be read; FileNotFoundError, ValueError: a path that is no model.
    """
    import json

    from magicpig_jax.io.checkpoint import MARKER, is_checkpoint

    root = Path(source)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist")
    if root.is_dir() and is_checkpoint(root):
        recorded = json.loads((root / MARKER).read_text()).get("weights_sha1")
        if isinstance(recorded, str):
            return recorded
    h = hashlib.sha1()
    if root.is_dir():
        from magicpig_jax.io.hf_model import hf_weight_files

        for path in hf_weight_files(root):
            with open(path, "rb") as f:
                header = int.from_bytes(f.read(8), "little")  # safetensors: header length, then the JSON
            _region_digest(h, path, path.relative_to(root).as_posix(), 8 + header)
    else:
        import gguf

        _region_digest(h, root, "", int(gguf.GGUFReader(str(root)).data_offset))
    return h.hexdigest()[:12]


def _region_digest(h, path: Path, name: str, start: int, chunks: int = 64, chunk_bytes: int = 1 << 16) -> None:
    """Feed ``name``, the length of ``path``'s bytes from ``start`` on and sampled pieces of them to ``h``."""
    size = max(path.stat().st_size - start, 0)
    h.update(f"{name}\0{size}\0".encode())
    with open(path, "rb") as f:
        for offset, length in sampled_pieces(size, chunks, chunk_bytes):
            f.seek(start + offset)
            h.update(f.read(length))
