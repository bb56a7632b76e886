"""Our GGUF tokenizers against llama.cpp's own tokenizer and the HF ``tokenizer.json`` (a one-off check).

  .venv/bin/python tools/tokenizer_vs_llama_cpp.py          # needs the [peer] extra (llama-cpp-python)

For each fixture tokenizer of ``tests/fixtures/families/tokenizers`` it writes a vocabulary-only
GGUF (``tests/fixtures/gguf_convert.tokenizer_metadata``) to a temporary folder, loads it in
llama.cpp with ``vocab_only=True``, and encodes fixed edge texts and seeded random strings with
llama.cpp, with ours (``Tokenizer.from_gguf_metadata``) and with ``tokenizers`` on the JSON; then
the same for the embedded SmolLM2 GGUF (llama.cpp against ours, special tokens parsed and not),
and compares the end-of-generation ids. Prints the counts of differing cases and the first few.
Where llama.cpp and the JSON disagree, the JSON is the reference this project follows.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FIXED = ["", " ", "  ", "\n", " \n\n \t ", "a  b   c    d", "x\r\ny\rz", "1 12 123 1234 12345 123456",
         "I'm you'RE they'll we'd IT'S", "ÀÉÎÕÜ àéîõü ñ ç ß ø", "e\u0301 a\u0308 o\u0302", "中文，日本語。한국어!",
         "🙂🙂 🚀x 👍🏽👍🏽", "tab\tseparated\tvalues", "trailing   ", "   leading", "<|im_start|>user\nhi<|im_end|>",
         "def f(x):\n    return x**2\n", "http://example.com/a?b=c&d=e"]
FAMILIES = [("llama-bpe", "llama-bpe"), ("qwen2", "qwen2"), ("tekken", "tekken"), ("smollm", "smollm"),
            ("gpt-2", "gpt-2"), ("llama", None)]


def _texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabet = "abcXYZ 019\n\r\t'.,!?-_éüÀ日本한😀\u0301\u0308<>|"
    return FIXED + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25))) for _ in range(n)]


def _vocab_only_gguf(meta: dict, out: Path) -> None:
    import gguf

    from tests.fixtures.gguf_convert import _add_metadata

    w = gguf.GGUFWriter(str(out), "llama")
    w.add_context_length(64), w.add_embedding_length(8), w.add_block_count(1), w.add_feed_forward_length(8)
    w.add_head_count(1), w.add_head_count_kv(1), w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(meta["tokenizer.ggml.tokens"]))
    _add_metadata(w, meta)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()


def _report(name: str, pairs: dict[str, list[tuple[str, list[int], list[int]]]], cases: int) -> None:
    for what, diffs in pairs.items():
        print(f"{name}: {cases} texts, {len(diffs)} differ ({what})")
        for s, a, b in diffs[:2]:
            print(f"    {s!r}: ours {a} / other {b}")


def main() -> int:
    import llama_cpp
    from tokenizers import Tokenizer as HFTokenizer

    from magicpig_jax.io.embedded import embedded_model_path
    from magicpig_jax.io.loader import load_model
    from magicpig_jax.io.tokenizer import Tokenizer
    from tests.fixtures.gguf_convert import tokenizer_metadata

    folder = ROOT / "tests/fixtures/families/tokenizers"
    texts = _texts(1500, 1)
    with tempfile.TemporaryDirectory() as tmp:
        for name, pre in FAMILIES:
            spm = json.loads((folder / "llama_spm_vocab.json").read_text()) if pre is None else None
            meta = tokenizer_metadata(folder / f"{name}.json", pre, spm_vocab=spm)
            if "tokenizer.ggml.bos_token_id" not in meta:
                meta["tokenizer.ggml.add_bos_token"] = False
            path = Path(tmp) / f"{name}.gguf"
            _vocab_only_gguf(meta, path)
            llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
            ours, hf = Tokenizer.from_gguf_metadata(meta), HFTokenizer.from_file(str(folder / f"{name}.json"))
            vs_llama, vs_hf = [], []
            for s in texts:
                a = ours.encode(s, parse_special=False)
                b = llm.tokenize(s.encode(), add_bos=False, special=False)
                c = hf.encode(s, add_special_tokens=False).ids
                if a != b:
                    vs_llama.append((s, a, b))
                if a != c:
                    vs_hf.append((s, a, c))
            _report(name, {"from llama.cpp": vs_llama, "from tokenizer.json": vs_hf}, len(texts))
    path = str(embedded_model_path())
    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    tok = load_model(path).tokenizer
    texts = _texts(3000, 0)
    for special in (True, False):
        diffs = [(s, a, b) for s in texts
                 if (a := tok.encode(s, parse_special=special))
                 != (b := llm.tokenize(s.encode(), add_bos=False, special=special))]
        _report(f"embedded SmolLM2 (special={special})", {"from llama.cpp": diffs}, len(texts))
    vocab = llama_cpp.llama_model_get_vocab(llm._model.model)
    eog = [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]
    print(f"end-of-generation ids: llama.cpp {eog}, ours {sorted(set(tok.eos_token_ids))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
