"""The sampled digests that name a model for eval's resume check (magicpig_jax.io.digest)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from magicpig_jax.io.digest import array_digest, sampled_pieces


@given(size=st.integers(0, 1 << 40), chunks=st.integers(1, 100), chunk_bytes=st.integers(1, 1 << 20))
def test_sampled_pieces_cover_both_ends_and_stay_in_bounds(size, chunks, chunk_bytes):
    pieces = sampled_pieces(size, chunks, chunk_bytes)
    if size <= chunks * chunk_bytes:
        assert pieces == [(0, size)]
        return
    assert len(pieces) == chunks and all(n == chunk_bytes for _, n in pieces)
    assert pieces[0][0] == 0 and all(0 <= o and o + n <= size for o, n in pieces)
    assert pieces[-1][0] + chunk_bytes == size or chunks == 1
    assert [o for o, _ in pieces] == sorted(o for o, _ in pieces)


@pytest.mark.parametrize("args", [(10, 0, 4), (10, 4, 0), (-1, 4, 4)])
def test_sampled_pieces_refuse_bad_arguments(args):
    with pytest.raises(ValueError, match="chunks and chunk_bytes must be >= 1"):
        sampled_pieces(*args)


def test_array_digest_sees_names_dtypes_shapes_and_sampled_bytes():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((300, 70)).astype(np.float32)
    base = array_digest({"w": a, "b": np.arange(3)}, chunks=4, chunk_bytes=64)
    assert base == array_digest({"b": np.arange(3), "w": a.copy()}, chunks=4, chunk_bytes=64)  # order-free
    edited = a.copy()
    edited.reshape(-1)[-1] += 1.0  # the last element: inside the last piece
    for other in ({"w": edited, "b": np.arange(3)}, {"v": a, "b": np.arange(3)},
                  {"w": a.astype(np.float64), "b": np.arange(3)}, {"w": a.reshape(70, 300), "b": np.arange(3)}):
        assert array_digest(other, chunks=4, chunk_bytes=64) != base
