"""llama.cpp as a decode-speed peer: the same GGUF file and prompt ids, B sequences in one batch.

``magicpig-jax bench decode --peer llama.cpp`` runs :func:`llama_cpp_batch_decode` in a child
process (``python -m magicpig_jax.eval.peer``, so that its peak RSS is its own) next to our
backends. llama.cpp (through the optional ``llama-cpp-python`` package, ``pip install -e
".[peer]"``; it compiles llama.cpp from source, about 10 minutes on two cores) runs the GGUF's
own quantized weights and reads its whole KV cache every step, so its cost per token grows with
the context; MagicPIG's sparse layers read only the sampled keys.

As on our side, the prompt is prefilled once (sequence 0) and its cache copied to the other
B - 1 sequences (``llama_memory_seq_cp``); then every step decodes one token of each of the B
sequences in one ``llama_decode`` call (``llama_batch_init`` with B sequence ids). The KV cache
is not unified (``kv_unified = False``: one stream per sequence, so the copy copies the data and
each sequence reads only its own cache, as our B rows do). Greedy tokens; the first step after
the prefill is not timed; each repeat removes the decoded tokens (``llama_memory_seq_rm``) and
decodes again from the prompt.

The functions that plan the batches (:func:`prefill_chunks`, :func:`step_entries`,
:func:`fill_batch`, :func:`context_size`) do not need the library.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

PEERS = ("llama.cpp",)
SEQ_CTX_PAD = 256  # llama.cpp pads the per-sequence context of a non-unified cache to 256


def llama_cpp_available() -> bool:
    """Whether ``llama_cpp`` (the ``llama-cpp-python`` package) can be imported."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


# ------------------------------------------------------------------------------------------
# Batch planning (no library needed).
# ------------------------------------------------------------------------------------------


def context_size(batch: int, prompt_len: int, steps: int) -> tuple[int, int]:
    """``(n_ctx, n_ctx_seq)`` of a non-unified context for ``batch`` sequences of the prompt plus
    ``steps`` decoded tokens (+1 spare position), per-sequence size padded to 256 as llama.cpp does.

    Raises:
      ValueError: ``batch < 1``, ``prompt_len < 1`` or ``steps < 0``.
    """
    if batch < 1 or prompt_len < 1 or steps < 0:
        raise ValueError(f"need batch >= 1, prompt_len >= 1, steps >= 0; got {batch}, {prompt_len}, {steps}")
    per_seq = -(-(prompt_len + steps + 1) // SEQ_CTX_PAD) * SEQ_CTX_PAD
    return batch * per_seq, per_seq


def prefill_chunks(prompt_ids: Sequence[int], n_batch: int) -> list[list[tuple[int, int, int, bool]]]:
    """The prefill of sequence 0 as llama.cpp batches of at most ``n_batch`` entries.

    Each entry is ``(token, position, sequence id, wants logits)``; only the prompt's last token
    asks for logits (they give the first decoded token).

    Raises:
      ValueError: an empty prompt or ``n_batch < 1``.
    """
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids must not be empty")
    if n_batch < 1:
        raise ValueError(f"n_batch must be >= 1, got {n_batch}")
    n = len(prompt_ids)
    entries = [(int(t), p, 0, p == n - 1) for p, t in enumerate(prompt_ids)]
    return [entries[i:i + n_batch] for i in range(0, n, n_batch)]


def step_entries(tokens: Sequence[int], position: int) -> list[tuple[int, int, int, bool]]:
    """One decode step of every sequence: entry ``s`` is ``(tokens[s], position, s, True)``.

    All B sequences hold the same prompt, so they are at the same position.
    """
    return [(int(t), int(position), s, True) for s, t in enumerate(tokens)]


def fill_batch(batch, entries: Sequence[tuple[int, int, int, bool]]) -> None:
    """Write ``entries`` into a ``llama_batch`` from ``llama_batch_init(n, 0, 1)`` (one sequence id
    per token) and set its ``n_tokens``. Works on any object with the same indexable fields."""
    for i, (tok, pos, seq, logits) in enumerate(entries):
        batch.token[i] = tok
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = 1 if logits else 0
    batch.n_tokens = len(entries)


# ------------------------------------------------------------------------------------------
# The run (needs llama-cpp-python).
# ------------------------------------------------------------------------------------------


def _stats(xs: Sequence[float]) -> dict:
    import numpy as np

    return {"median": float(np.median(xs)), "min": float(np.min(xs)), "max": float(np.max(xs)),
            "values": [float(x) for x in xs]}


def llama_cpp_batch_decode(model_path: str | Path, prompt_ids: Sequence[int], batches: Sequence[int], steps: int,
                           repeats: int = 3, *, n_threads: int | None = None, n_batch: int = 512,
                           rss=None, warmup: int = 0) -> list[dict]:
    """For each B of ``batches``: prefill ``prompt_ids`` once, copy its cache to B sequences, and time
    ``repeats`` greedy decodes of ``steps`` tokens of all B sequences together.

    Args:
      model_path: the GGUF file (the one our loader reads).
      prompt_ids: prompt token ids (our tokenizer's; the GGUF vocabulary is shared).
      batches: the batch sizes B (one llama.cpp context each, ``n_seq_max = B``).
      steps: ``llama_decode`` calls per repeat (one token of every sequence each); the first is not
        timed. ``>= 2``. The first token comes from the prefill's logits.
      repeats: timed repeats per B, ``>= 1``.
      warmup: untimed decodes per B before them, ``>= 0`` (as ``bench decode --warmup`` runs on our
        side).
      n_threads: llama.cpp threads (default: every CPU this process may run on, as XLA's count;
        ``os.cpu_count()`` counts the machine's, more than a ``taskset`` allows).
      n_batch: prefill batch size (tokens per ``llama_decode``).
      rss: optional object with ``reset()`` and ``peak_bytes()`` (the peak RSS of each B).

    Returns:
      one dict per B: ``batch``, ``ms_per_step`` and ``tokens_per_s`` (aggregate: B tokens per step)
      as ``{median, min, max, values}`` over the repeats, ``prefill_seconds``, ``tokens`` (sequence
      0's greedy ids), ``rows_identical`` (every sequence decoded the same ids), ``peak_rss_bytes``,
      ``version``, ``threads``, ``warmup``.

    Raises:
      ImportError: ``llama-cpp-python`` is not installed (install the ``peer`` extra).
      ValueError: ``steps < 2``, ``repeats < 1``, ``warmup < 0``, an empty prompt or a batch size < 1.
      RuntimeError: llama.cpp failed to load the model, create a context or decode.
    """
    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the first is not timed), got {steps}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids must not be empty")
    if not batches or min(batches) < 1:
        raise ValueError(f"batch sizes must be >= 1, got {list(batches)}")
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - depends on the optional extra
        raise ImportError("the llama.cpp peer needs llama-cpp-python: pip install -e '.[peer]' "
                          "(compiles llama.cpp, about 10 minutes)") from e
    import llama_cpp.llama_cpp as low
    import numpy as np

    threads = n_threads or default_threads()
    low.llama_backend_init()
    mparams = low.llama_model_default_params()
    # llama.cpp's AMX "extra buffer type" (chosen automatically on CPUs with AMX) crashed in
    # ggml_backend_amx_mul_mat on this Q4_1 file (llama-cpp-python 0.3.36, Sapphire Rapids);
    # the plain CPU buffers (AVX-512 / AVX2 kernels) are used instead.
    mparams.use_extra_bufts = False
    model = low.llama_model_load_from_file(str(model_path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    n_vocab = low.llama_vocab_n_tokens(low.llama_model_get_vocab(model))
    results = []
    try:
        for B in batches:
            if rss is not None:
                rss.reset()
            from magicpig_jax.eval.rss import OtherLoad

            with OtherLoad() as load:
                results.append(_one_batch(low, model, n_vocab, list(prompt_ids), int(B), steps, repeats, threads,
                                          n_batch, np, warmup))
            results[-1]["other_processes_cpu_fraction"] = load.fraction
            if rss is not None:
                results[-1]["peak_rss_bytes"] = rss.peak_bytes()
            results[-1].update(version=llama_cpp.__version__, threads=threads, warmup=warmup)
    finally:
        low.llama_model_free(model)
    return results


def default_threads() -> int:
    """The CPUs this process may run on (``os.sched_getaffinity``; ``os.cpu_count()`` where it is
    missing): the threads XLA uses, and so the peer's default. ``os.cpu_count()`` counts the
    machine's CPUs, more than ``taskset -c 0`` allows."""
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return allowed or 1


def _one_batch(low, model, n_vocab, prompt_ids, B, steps, repeats, threads, n_batch, np, warmup=0) -> dict:
    n = len(prompt_ids)
    n_ctx, _ = context_size(B, n, steps)
    cparams = low.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = max(n_batch, B)
    cparams.n_ubatch = max(n_batch, B)
    cparams.n_seq_max = B
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.kv_unified = False
    ctx = low.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError(f"llama.cpp could not create a context for B={B}, n_ctx={n_ctx}")
    batch = low.llama_batch_init(max(n_batch, B), 0, 1)
    try:
        mem = low.llama_get_memory(ctx)

        def decode(entries):
            fill_batch(batch, entries)
            rc = low.llama_decode(ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc} (B={B})")

        def argmax(i):
            return int(np.argmax(np.ctypeslib.as_array(low.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))

        t = time.perf_counter()
        for chunk in prefill_chunks(prompt_ids, n_batch):
            decode(chunk)
        first = argmax(-1)
        for s in range(1, B):
            low.llama_memory_seq_cp(mem, 0, s, -1, -1)
        prefill_s = time.perf_counter() - t
        ms, rows = [], None
        for run in range(warmup + repeats):
            for s in range(B):
                low.llama_memory_seq_rm(mem, s, n, -1)  # back to the prompt alone
            tokens = [first] * B
            out = [[first] for _ in range(B)]
            t0 = time.perf_counter()
            for step in range(steps):
                if step == 1:  # the first step is not timed (as on our side, where it compiles)
                    t0 = time.perf_counter()
                decode(step_entries(tokens, n + step))
                tokens = [argmax(i) for i in range(B)]
                for s in range(B):
                    out[s].append(tokens[s])
            if run >= warmup:  # the warm-up runs are not timed
                ms.append(1000.0 * (time.perf_counter() - t0) / (steps - 1))
            rows = out
        tps = [1000.0 * B / m for m in ms]  # the median B x 1000 / median ms, as ours (bench_decode.throughput_spread)
        return {"batch": B, "ms_per_step": _stats(ms), "tokens_per_s": {**_stats(tps), "median": 1000.0 * B / float(
            np.median(ms))},
                "ms_per_token": float(np.median(ms)) / B, "prefill_seconds": prefill_s,
                "tokens": rows[0], "rows_identical": all(r == rows[0] for r in rows)}
    finally:
        low.llama_batch_free(batch)
        low.llama_free(ctx)


def main(argv: list[str] | None = None) -> int:
    """Child-process entry of ``bench decode --peer llama.cpp``: reads prompt ids, writes JSON."""
    from magicpig_jax.eval.rss import PeakRSS

    p = argparse.ArgumentParser(prog="python -m magicpig_jax.eval.peer")
    p.add_argument("--model", required=True)
    p.add_argument("--ids", required=True, help="JSON file with the prompt ids")
    p.add_argument("--batch", type=int, nargs="+", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", required=True, help="JSON file for the results")
    args = p.parse_args(argv)
    ids = json.loads(Path(args.ids).read_text())
    res = llama_cpp_batch_decode(args.model, ids, args.batch, args.steps, args.repeats, n_threads=args.threads,
                                 rss=PeakRSS(), warmup=args.warmup)
    Path(args.out).write_text(json.dumps(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
