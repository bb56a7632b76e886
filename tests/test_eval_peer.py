"""magicpig_jax.eval.peer: the llama.cpp batch peer's plan (prefill chunks, one batch of B sequences per
step, context size, filling a llama_batch) and its argument checks, none of which needs llama-cpp-python."""

from __future__ import annotations

import types

import pytest

from magicpig_jax.eval.peer import context_size, fill_batch, llama_cpp_batch_decode, prefill_chunks, step_entries


def test_prefill_chunks_cover_the_prompt_in_order_with_logits_at_the_end():
    ids = list(range(100, 1100))
    chunks = prefill_chunks(ids, 512)
    assert [len(c) for c in chunks] == [512, 488]
    flat = [e for c in chunks for e in c]
    assert [e[0] for e in flat] == ids and [e[1] for e in flat] == list(range(1000))
    assert {e[2] for e in flat} == {0}
    assert [e[3] for e in flat] == [False] * 999 + [True]
    assert prefill_chunks([7], 4) == [[(7, 0, 0, True)]]


def test_step_entries_one_token_per_sequence():
    assert step_entries([5, 6, 7], 1024) == [(5, 1024, 0, True), (6, 1024, 1, True), (7, 1024, 2, True)]


def test_context_size_pads_each_sequence_to_256():
    assert context_size(1, 1024, 32) == (1280, 1280)
    assert context_size(16, 8192, 32) == (16 * 8448, 8448)
    assert context_size(4, 1, 0) == (4 * 256, 256)


def test_fill_batch_writes_every_field():
    n = 4
    batch = types.SimpleNamespace(token=[0] * n, pos=[0] * n, n_seq_id=[0] * n, seq_id=[[9] for _ in range(n)],
                                  logits=[0] * n, n_tokens=0)
    fill_batch(batch, step_entries([11, 12, 13], 40))
    assert batch.n_tokens == 3
    assert batch.token[:3] == [11, 12, 13] and batch.pos[:3] == [40, 40, 40]
    assert batch.n_seq_id[:3] == [1, 1, 1] and [s[0] for s in batch.seq_id[:3]] == [0, 1, 2]
    assert batch.logits[:3] == [1, 1, 1]
    fill_batch(batch, prefill_chunks([1, 2], 8)[0])
    assert batch.n_tokens == 2 and batch.logits[:2] == [0, 1] and [s[0] for s in batch.seq_id[:2]] == [0, 0]


@pytest.mark.parametrize("bad", [dict(steps=1), dict(repeats=0), dict(warmup=-1), dict(prompt_ids=[]),
                                 dict(batches=[0]), dict(batches=[])])
def test_batch_decode_checks_arguments_before_loading(tmp_path, bad):
    kw = dict(model_path=tmp_path / "model.gguf", prompt_ids=[1, 2, 3], batches=[1, 4], steps=4, repeats=3) | bad
    with pytest.raises(ValueError):
        llama_cpp_batch_decode(**kw)


def test_bench_decode_refuses_the_peer_without_the_library(monkeypatch):
    from magicpig_jax.eval import bench_decode

    monkeypatch.setattr(bench_decode, "llama_cpp_available", lambda: False)
    with pytest.raises(SystemExit):
        bench_decode.main(["--peer", "llama.cpp", "--lengths", "128"])
    with pytest.raises(SystemExit):
        bench_decode.main(["--repeats", "2"])


def test_the_peer_threads_default_to_the_cpus_this_process_may_use(monkeypatch):
    """Under ``taskset -c 0`` os.cpu_count() still says 2 while XLA uses 1: the peer had 2 threads."""
    import os

    from magicpig_jax.eval import peer

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert peer.default_threads() == 1
    monkeypatch.delattr(os, "sched_getaffinity")
    assert peer.default_threads() == 2
