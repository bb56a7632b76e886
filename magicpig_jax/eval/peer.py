"""llama.cpp as a decode-speed peer: the same GGUF file and prompt ids, timed per decoded token.

``magicpig-jax bench decode --peer llama.cpp`` calls :func:`llama_cpp_decode` next to our
own backends in one run. llama.cpp (through the optional ``llama-cpp-python`` package,
``pip install -e ".[peer]"``; it compiles llama.cpp from source, about 10 minutes on two
cores) runs the GGUF's own quantized weights and reads its whole KV cache every step, so
its cost per token grows with the context; MagicPIG's sparse layers read only the sampled
keys. Not part of the test suite.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

PEERS = ("llama.cpp",)


def llama_cpp_available() -> bool:
    """Whether ``llama_cpp`` (the ``llama-cpp-python`` package) can be imported."""
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_decode(model_path: str | Path, prompt_ids: Sequence[int], steps: int, *,
                     n_threads: int | None = None, n_batch: int = 512) -> dict:
    """Prefill ``prompt_ids`` in llama.cpp, then decode ``steps`` tokens greedily, one call per token.

    Args:
      model_path: the GGUF file (the one our loader reads).
      prompt_ids: prompt token ids (our tokenizer's; the GGUF vocabulary is shared).
      steps: decoded tokens; the first (which follows the prefill) is not timed. Must be >= 2.
      n_threads: llama.cpp threads (default: every CPU).
      n_batch: prefill batch size (tokens per llama.cpp batch).

    Returns:
      dict with ``prefill_seconds``, ``ms_per_token`` (mean over the ``steps - 1`` timed
      steps, milliseconds), ``tokens_per_s``, ``tokens`` (the greedy ids), ``version`` and
      ``threads``.

    Raises:
      ImportError: ``llama-cpp-python`` is not installed (install the ``peer`` extra).
      ValueError: ``steps < 2`` or an empty prompt.
    """
    if steps < 2:
        raise ValueError(f"steps must be >= 2 (the first is not timed), got {steps}")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids must not be empty")
    try:
        import llama_cpp
    except ImportError as e:  # pragma: no cover - depends on the optional extra
        raise ImportError("the llama.cpp peer needs llama-cpp-python: pip install -e '.[peer]' "
                          "(compiles llama.cpp, about 10 minutes)") from e
    import llama_cpp.llama_cpp as low
    import numpy as np

    n_ctx = len(prompt_ids) + steps + 8
    threads = n_threads or os.cpu_count() or 1
    # llama.cpp's AMX "extra buffer type" (chosen automatically on CPUs with AMX) crashed in
    # ggml_backend_amx_mul_mat on this Q4_1 file (llama-cpp-python 0.3.36, Sapphire Rapids);
    # the plain CPU buffers (AVX-512 / AVX2 kernels) are used instead.
    default_params = low.llama_model_default_params

    def model_params():
        params = default_params()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = model_params
    try:
        llm = llama_cpp.Llama(model_path=str(model_path), n_ctx=n_ctx, n_batch=n_batch, n_threads=threads,
                              n_threads_batch=threads, logits_all=False, verbose=False)
    finally:
        low.llama_model_default_params = default_params
    n_vocab = llm.n_vocab()

    def last_logits():
        return np.ctypeslib.as_array(low.llama_get_logits(llm.ctx), shape=(n_vocab,))

    try:
        t = time.perf_counter()
        llm.eval(list(prompt_ids))
        prefill_s = time.perf_counter() - t
        tokens = []
        t0 = None
        for step in range(steps):
            tok = int(np.argmax(last_logits()))
            tokens.append(tok)
            if step == 1:
                t0 = time.perf_counter()
            llm.eval([tok])
        seconds = time.perf_counter() - t0
    finally:
        llm.close()
    timed = steps - 1
    return {"prefill_seconds": prefill_s, "ms_per_token": 1000.0 * seconds / timed,
            "tokens_per_s": timed / seconds, "tokens": tokens, "version": llama_cpp.__version__,
            "threads": threads}
