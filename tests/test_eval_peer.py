"""magicpig_jax.eval.peer: the llama.cpp decode peer checks its arguments before loading anything."""

from __future__ import annotations

import pytest


def test_llama_cpp_peer_validates_before_loading(tmp_path, monkeypatch):
    from magicpig_jax.eval import bench_decode
    from magicpig_jax.eval.peer import llama_cpp_decode

    with pytest.raises(ValueError, match="steps"):
        llama_cpp_decode(tmp_path / "model.gguf", [1, 2, 3], 1)
    with pytest.raises(ValueError, match="prompt_ids"):
        llama_cpp_decode(tmp_path / "model.gguf", [], 4)
    monkeypatch.setattr(bench_decode, "llama_cpp_available", lambda: False)
    with pytest.raises(SystemExit):
        bench_decode.main(["--peer", "llama.cpp", "--lengths", "128"])
