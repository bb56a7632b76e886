"""Random valid GGUF rows of every type the model holds as rows, and the float64 reference
product of gguf-py's dequantization with its float32 error bound (shared by the tests)."""

from __future__ import annotations

import gguf
import numpy as np

from magicpig_jax.io.gguf_blocks import QUANT_TYPES

# byte offsets of the float16 scales (d, m, dmin) inside each type's block
F16_AT = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2],
          "Q6_K": [208]}
# subnormal, signed zeros, the smallest normal, the largest finite
SPECIAL_F16 = np.array([6e-8, -3e-6, 0.0, -0.0, 6.1e-5, 65504.0, -65504.0], np.float16)


def gguf_type(qtype: str):
    return gguf.GGMLQuantizationType[qtype]


def reference(x: np.ndarray, rows: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """float64 ``x @ W.T`` with W from gguf.quants.dequantize, and the float32 error bound
    ``n * eps * (|x| @ |W|.T)`` of any summation order (plus a subnormal floor)."""
    w = np.asarray(gguf.quants.dequantize(rows, gguf_type(qtype)), np.float64)
    x64 = np.asarray(x, np.float64)
    bound = x.shape[-1] * np.finfo(np.float32).eps * (np.abs(x64) @ np.abs(w).T) + 1e-30
    return x64 @ w.T, bound


def random_rows(rng: np.random.Generator, qtype: str, rows: int, n_in: int, scale: float = 0.02,
                special: bool = False) -> np.ndarray:
    """Random valid GGUF rows ``[rows, RB]``: random quant bytes and finite f16 scales (with
    ``special``, the scales are drawn from subnormals, zeros and extremes instead)."""
    _, bb, bw = QUANT_TYPES[qtype]
    if qtype in ("F16", "BF16"):
        w = (rng.standard_normal((rows, n_in)) * scale).astype(np.float32)
        if special:
            w = rng.choice(SPECIAL_F16.astype(np.float32), (rows, n_in))
        if qtype == "F16":
            return w.astype(np.float16).view(np.uint8).reshape(rows, -1)
        return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(rows, -1)
    nb = n_in // bw
    blocks = rng.integers(0, 256, (rows, nb, bb), dtype=np.uint8)
    for at in F16_AT[qtype]:
        f16 = rng.choice(SPECIAL_F16, (rows, nb)) if special else (rng.standard_normal((rows, nb)) * scale)
        blocks[:, :, at:at + 2] = f16.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return blocks.reshape(rows, nb * bb)


def add_kv(writer: gguf.GGUFWriter, key: str, value) -> None:
    """Write one metadata value with the GGUF type its Python type maps to: bool, uint32 (int),
    float32, string, or an array (a list)."""
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    else:
        writer.add_array(key, value)
