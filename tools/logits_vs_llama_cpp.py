"""Our decoder's logits against llama.cpp's on the same GGUF (a one-off check; needs the [peer] extra).

  .venv/bin/python tools/logits_vs_llama_cpp.py                 # the embedded SmolLM2, as shipped (Q4_1)
  .venv/bin/python tools/logits_vs_llama_cpp.py --float32       # its weights dequantized to an F32 GGUF
  .venv/bin/python tools/logits_vs_llama_cpp.py --yarn 4 256    # the F32 copy with YaRN metadata added

Prefills prefixes of the GPL-3 text's first 600 token ids with our dense prefill and compares the
next-token logits with llama.cpp's (one evaluation of the 600 ids, ``logits_all``, 2 threads).
With ``--float32`` the Q4_1 blocks are dequantized with gguf-py into a temporary F32 GGUF (the
metadata copied as is) and llama.cpp keeps a float32 KV cache without flash attention, so both
sides compute in float32 from the same numbers; on the shipped file llama.cpp quantizes the
activations of its Q4_1 products (to Q8_1) and keeps a float16 cache, which we do not.
Prints, per prefix length, the largest absolute logit difference, the argmax of each side, and
KL(llama.cpp || ours) of the next-token distributions.

``--yarn FACTOR ORIGINAL`` adds ``rope.scaling.type = yarn``, ``rope.scaling.factor`` and
``rope.scaling.original_context_length`` to the F32 copy, so that both sides run YaRN RoPE over
prefixes that reach past ``ORIGINAL`` positions (the model was not trained for it: the check is
that the two computations agree, not that the text is likely).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

GPL3 = Path("/usr/share/common-licenses/GPL-3")


def _float32_copy(src: str, out: Path, yarn: tuple[float, int] | None = None) -> None:
    """An F32 GGUF of ``src``: every tensor dequantized with gguf-py, every metadata field copied
    (and YaRN's three keys added when ``yarn`` = ``(factor, original context)``)."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    r = GGUFReader(src)
    w = GGUFWriter(str(out), bytes(r.fields["general.architecture"].parts[-1]).decode())
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = f.types[0]
        if kind == GGUFValueType.ARRAY:
            strings = f.types[-1] == GGUFValueType.STRING
            w.add_array(name, [bytes(f.parts[i]).decode() if strings else f.parts[i].tolist()[0] for i in f.data])
        elif kind == GGUFValueType.STRING:
            w.add_string(name, bytes(f.parts[-1]).decode())
        else:
            w.add_key_value(name, f.parts[-1].tolist()[0], kind)
    if yarn is not None:
        arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
        w.add_string(f"{arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{arch}.rope.scaling.factor", float(yarn[0]))
        w.add_uint32(f"{arch}.rope.scaling.original_context_length", int(yarn[1]))
    for t in r.tensors:
        shape = [int(x) for x in reversed(t.shape.tolist())]
        w.add_tensor(t.name, dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--float32", action="store_true", help="compare on an F32 copy of the weights")
    p.add_argument("--yarn", nargs=2, type=float, metavar=("FACTOR", "ORIGINAL"),
                   help="the F32 copy with YaRN RoPE scaling (factor, original context) in its metadata")
    args = p.parse_args(argv)
    yarn = None if args.yarn is None else (args.yarn[0], int(args.yarn[1]))

    import llama_cpp
    import numpy as np

    from magicpig_jax.generation import prefill
    from magicpig_jax.io.embedded import embedded_model_path
    from magicpig_jax.io.loader import load_model

    with tempfile.TemporaryDirectory() as tmp:
        path = str(embedded_model_path())
        extra = {}
        if args.float32 or yarn is not None:
            _float32_copy(path, Path(tmp) / "f32.gguf", yarn)
            path = str(Path(tmp) / "f32.gguf")
            extra = dict(type_k=0, type_v=0, flash_attn=False)  # GGML_TYPE_F32 cache
        model = load_model(path)
        ids = model.tokenizer.encode(GPL3.read_text()[:6000])[:600]
        llm = llama_cpp.Llama(model_path=path, n_ctx=1024, logits_all=True, n_threads=2, verbose=False, **extra)
        llm.eval(ids)
        theirs = np.array(llm.scores[: len(ids)], np.float64)
        for n in (1, 7, 64, 257, 600):
            ours = np.asarray(prefill(model, [ids[:n]], 1).last_logits, np.float64)[0]
            t = theirs[n - 1]
            p_t = np.exp(t - t.max())
            p_t /= p_t.sum()
            log_q = ours - ours.max() - np.log(np.exp(ours - ours.max()).sum())
            kl = float(np.sum(p_t * (np.log(p_t) - log_q)))
            print(f"prefix {n:4d}: max |logit diff| {np.abs(ours - t).max():.2e} (llama.cpp's logit std "
                  f"{t.std():.2f}); argmax ours {int(ours.argmax())}, llama.cpp {int(t.argmax())}; "
                  f"KL(llama.cpp || ours) {kl:.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
