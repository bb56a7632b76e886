"""RULER-style synthetic long-context tasks, generated offline and seeded, and RULER's scoring.

RULER (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", 2024, arXiv 2404.06654) is one of the benchmarks on which MagicPIG reports its
accuracy (arXiv 2410.16179, Section 5.1, Table 3); its aggregation tasks (common / frequent
words extraction) are where sampling beats exact TopK (Section 3, Fig. 2). The generators
here follow RULER's ``scripts/data/synthetic`` task definitions (templates, needle format,
answer prefixes, RULER's ``synthetic.yaml`` complexity), with these documented changes:

* the haystack is real prose shipped by a package (:mod:`magicpig_jax.eval.corpus`: the
  Jargon File, or the license texts) instead of Paul Graham's essays / the repeated
  "grass is green" noise; variable tracking uses the same prose as its haystack;
* words come from ``wonderwords`` (as in RULER); keys are ``adjective-noun``, values 7-digit
  numbers that never occur anywhere in the corpus (not even inside a longer number), variable names 5 upper-case letters
  that never occur as a word of the corpus;
* every random choice that is not the haystack size is drawn before the haystack is sized,
  so a sample's keys, values, needle depths and answers do not change while
  :func:`make_sample` searches the haystack size that fits the token budget;
* RULER's VT answer prefix ends with a space; here it is stripped (a trailing space is an unusual
  BPE token that the model then has to continue from);
* fewer new tokens than RULER (:data:`MAX_NEW_TOKENS`; RULER: 128 for NIAH, 30 VT,
  120 CWE, 50 FWE) — enough for the answers, since decode time is the cost here.

Tasks (:data:`TASKS`):

``niah_single``      one needle ``One of the special magic numbers for {key} is: {value}.``
``niah_multikey``    4 needles with different keys; one is asked (3 distractors)
``niah_multivalue``  4 needles with the same key; all 4 values are asked
``niah_multiquery``  4 needles with different keys; all 4 are asked
``vt``               variable tracking: one chain of 4 hops ``VAR B = VAR A`` from a 5-digit value
``cwe``              common words extraction: the 10 most frequent words of a numbered list
                     (30 vs 3 repetitions; 6 vs 1 under 4K tokens, as RULER), with RULER's one-shot example
``fwe``              frequent words extraction: Zipf (alpha 2) coded words, the 3 most frequent
                     after the top one (which is ``...``, noise), as RULER

Scoring (:func:`score`) is RULER's ``string_match_all``: the fraction of expected strings
that occur in the prediction, case-insensitively (RULER multiplies by 100).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import re
import string
import zlib
from collections.abc import Callable, Sequence

from magicpig_jax.eval.corpus import DEFAULT_HAYSTACK, load_prose, load_sentences, word_lists

__all__ = [
    "TASKS",
    "MAX_NEW_TOKENS",
    "Sample",
    "make_sample",
    "check_length_fits",
    "sample_seed",
    "score",
    "string_match_all",
    "string_match_part",
    "postprocess_pred",
    "parse_tasks",
]

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe")
MAX_NEW_TOKENS = {"niah_single": 24, "niah_multikey": 24, "niah_multivalue": 56, "niah_multiquery": 56,
                  "vt": 32, "cwe": 64, "fwe": 24}

# --- RULER's templates (scripts/data/synthetic/constants.py) ---------------------------------
NIAH_TEMPLATE = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_v} afterwards.\n{context}\n"
                 "What are all the special magic {type_v} for {query} mentioned in the provided text?")
NIAH_NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\n"
                "Question: What are the 10 most common words in the above list?")
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                "ignore the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"

DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER: 40 evenly spaced needle depths, in percent
_NIAH = {  # (number of keys, values per key, keys asked) as RULER's synthetic.yaml
    "niah_single": (1, 1, 1),
    "niah_multikey": (4, 1, 1),
    "niah_multivalue": (1, 4, 1),
    "niah_multiquery": (4, 1, 4),
}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One generated task instance.

    Attributes:
      task: one of :data:`TASKS`.
      length: the target context length (tokens: prompt + new tokens).
      index: the sample's index at that task and length.
      seed: the seed it was generated from (see :func:`sample_seed`).
      prompt: the user message (the chat template is applied by the runner).
      answer_prefix: text that starts the assistant's turn (RULER's answer prefix).
      outputs: the expected strings (scored by :func:`score`).
      max_new_tokens: decode budget of the task.
      units: haystack size (sentences, list entries or coded words).
    """

    task: str
    length: int
    index: int
    seed: int
    prompt: str
    answer_prefix: str
    outputs: tuple[str, ...]
    max_new_tokens: int
    units: int

    @property
    def question(self) -> str:
        """The question: the prompt's last line, after the document (RULER's templates put it there).

        Setup B of the evaluation prefills the document and decodes this question (and the
        answer prefix) with the method under test (:mod:`magicpig_jax.eval.run`).
        """
        return self.prompt.rsplit("\n", 1)[-1]


def parse_tasks(text: str) -> list[str]:
    """Comma-separated task names (``all`` = every task, ``niah`` = the four NIAH tasks).

    Raises:
      ValueError: an unknown name.
    """
    out: list[str] = []
    for name in (x.strip() for x in text.split(",")):
        if not name:
            continue
        names = TASKS if name == "all" else [t for t in TASKS if t.startswith("niah_")] if name == "niah" else [name]
        for n in names:
            if n not in TASKS:
                raise ValueError(f"unknown task {n!r}; tasks: {', '.join(TASKS)} (or all, niah)")
            if n not in out:
                out.append(n)
    if not out:
        raise ValueError(f"no task given; tasks: {', '.join(TASKS)}")
    return out


def sample_seed(task: str, length: int, index: int, seed: int = 0) -> int:
    """A stable per-sample seed (CRC32 of the identifying fields; independent of PYTHONHASHSEED)."""
    return zlib.crc32(f"{task}|{length}|{index}|{seed}".encode())


# --- scoring (RULER's scripts/eval/synthetic/constants.py) ------------------------------------

def postprocess_pred(pred: str) -> str:
    """RULER's post-processing: control characters become newlines, then strip."""
    return re.sub(r"[\x00-\x1f]", "\n", pred.strip()).strip()


def string_match_all(pred: str, refs: Sequence[str]) -> float:
    """Fraction of ``refs`` that occur in ``pred``, case-insensitively (RULER's metric / 100)."""
    if not refs:
        raise ValueError("refs must be non-empty")
    p = pred.lower()
    return sum(1.0 for r in refs if r.lower() in p) / len(refs)


def string_match_part(pred: str, refs: Sequence[str]) -> float:
    """1 if any of ``refs`` occurs in ``pred`` (RULER's QA metric / 100)."""
    if not refs:
        raise ValueError("refs must be non-empty")
    p = pred.lower()
    return max(1.0 if r.lower() in p else 0.0 for r in refs)


def score(task: str, pred: str, refs: Sequence[str]) -> float:
    """RULER's score of one prediction in [0, 1]: ``string_match_all`` for every task here."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}")
    return string_match_all(postprocess_pred(pred), refs)


# --- corpus-derived forbidden strings ---------------------------------------------------------

@functools.cache
def _corpus_text(haystack: str) -> str:
    return "\n".join(load_prose(haystack))


@functools.cache
def _forbidden_numbers(haystack: str) -> frozenset[str]:
    return frozenset(re.findall(r"\d+", _corpus_text(haystack)))


def _in_corpus_number(value: str, haystack: str) -> bool:
    """Whether the digits ``value`` occur in the corpus, alone or inside a longer number: the scorer
    matches substrings, so a value inside the haystack's 957727603 could be copied from it."""
    return any(value in run for run in _forbidden_numbers(haystack) if len(run) >= len(value))


@functools.cache
def _forbidden_upper(haystack: str) -> frozenset[str]:
    return frozenset(w.upper() for w in re.findall(r"[A-Za-z]+", _corpus_text(haystack)))


def _window(sentences: Sequence[str], start: int, n: int) -> list[str]:
    """``n`` consecutive sentences from ``start``, wrapping around the corpus."""
    m = len(sentences)
    return [sentences[(start + i) % m] for i in range(n)]


def _join_and(items: Sequence[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + ", and " + items[-1]


# --- generators: each returns a builder n -> (prompt, answer_prefix, outputs) -------------------

Builder = Callable[[int], tuple[str, str, tuple[str, ...]]]


def _niah(task: str, seed: int, haystack: str) -> Builder:
    num_k, num_v, num_q = _NIAH[task]
    rng = random.Random(seed)
    words = word_lists()
    keys: list[str] = []
    while len(keys) < num_k:
        k = f"{rng.choice(words['adjectives'])}-{rng.choice(words['nouns'])}"
        if k not in keys:
            keys.append(k)
    values: list[list[str]] = []
    used: set[str] = set()
    for _ in keys:
        vs = []
        while len(vs) < num_v:
            v = str(rng.randint(10**6, 10**7 - 1))
            if v not in used and not _in_corpus_number(v, haystack):
                used.add(v)
                vs.append(v)
        values.append(vs)
    type_v = "numbers"
    needles = [NIAH_NEEDLE.format(type_v=type_v, key=k, value=v) for k, vs in zip(keys, values, strict=True)
               for v in vs]
    rng.shuffle(needles)
    depths = sorted(rng.sample(DEPTHS, len(needles)))
    asked = rng.sample(range(num_k), num_q)
    query = _join_and([keys[i] for i in asked])
    outputs = tuple(v for i in asked for v in values[i])
    sentences = load_sentences(haystack)
    start = rng.randrange(len(sentences))
    if num_q * num_v == 1:
        prefix = f"The special magic number for {query} mentioned in the provided text is"
    else:
        prefix = f"The special magic {type_v} for {query} mentioned in the provided text are"

    def build(n: int):
        sents = _window(sentences, start, n)
        pieces: list[str] = []
        prev = 0
        for needle, depth in zip(needles, depths, strict=True):
            pos = int(n * depth / 100)
            pieces.extend(sents[prev:pos])
            pieces.append(needle)
            prev = pos
        pieces.extend(sents[prev:])
        prompt = NIAH_TEMPLATE.format(type_v=type_v, context=" ".join(pieces), query=query)
        return prompt, prefix, outputs

    return build


def _vt(seed: int, haystack: str, num_hops: int = 4) -> Builder:
    rng = random.Random(seed)
    forbidden = _forbidden_upper(haystack) | {"VAR"}
    names: list[str] = []
    while len(names) < num_hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names and name not in forbidden:
            names.append(name)
    while True:
        value = str(rng.randint(10000, 99999))
        if not _in_corpus_number(value, haystack):
            break
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[j + 1]} = VAR {names[j]}." for j in range(num_hops)]
    fracs = sorted(rng.random() for _ in chain)
    sentences = load_sentences(haystack)
    start = rng.randrange(len(sentences))
    prefix = VT_PREFIX.format(num_v=len(names), query=value).rstrip()  # RULER ends it with a space

    def build(n: int):
        sents = _window(sentences, start, n)
        pieces: list[str] = []
        prev = 0
        for stmt, f in zip(chain, fracs, strict=True):
            pos = int(n * f)
            pieces.extend(sents[prev:pos])
            pieces.append(stmt)
            prev = pos
        pieces.extend(sents[prev:])
        return VT_TEMPLATE.format(context=" ".join(pieces), query=value), prefix, tuple(names)

    return build


def _cwe(seed: int, length: int, num_cw: int = 10) -> Builder:
    rng = random.Random(seed)
    w = word_lists()
    vocab = sorted(set(w["nouns"]) | set(w["adjectives"]) | set(w["verbs"]))
    order = rng.sample(vocab, len(vocab))  # a seeded permutation: common words first, then the rest
    freq_cw, freq_ucw = (6, 1) if length < 4096 else (30, 3)  # as RULER
    ex_n, ex_cw, ex_ucw = (20, 3, 1) if length < 4096 else (40, 10, 3)
    ex_words = rng.sample(vocab, ex_n)
    ex_list = ex_words[:num_cw] * ex_cw + ex_words[num_cw:] * ex_ucw
    rng.shuffle(ex_list)
    ex_context = " ".join(f"{i + 1}. {word}" for i, word in enumerate(ex_list))
    ex_answer = " ".join(f"{i + 1}. {word}" for i, word in enumerate(ex_words[:num_cw]))
    example = CWE_TEMPLATE.format(context=ex_context) + " " + CWE_PREFIX + " " + ex_answer
    common = [x for x in order if x not in ex_words][:num_cw]
    rest = [x for x in order if x not in ex_words and x not in common]
    shuffle_seed = rng.getrandbits(64)

    def build(n: int):
        n = min(n, len(rest))
        lst = common * freq_cw + rest[:n] * freq_ucw
        random.Random(shuffle_seed).shuffle(lst)
        context = " ".join(f"{i + 1}. {word}" for i, word in enumerate(lst))
        return example + "\n" + CWE_TEMPLATE.format(context=context), CWE_PREFIX, tuple(common)

    return build


def _fwe(seed: int, alpha: float = 2.0, vocab_size: int = 2000, word_len: int = 6) -> Builder:
    rng = random.Random(seed)
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < vocab_size:
        wd = "".join(rng.choices(string.ascii_lowercase, k=word_len))
        if wd not in seen:
            seen.add(wd)
            vocab.append(wd)
    vocab[0] = "..."  # RULER: the top-ranked word is noise
    zeta = sum(k ** -alpha for k in range(1, 100_000)) + 100_000 ** (1 - alpha) / (alpha - 1)
    shuffle_seed = rng.getrandbits(64)

    def build(n: int):
        counts = [int(n * k ** -alpha / zeta) for k in range(1, vocab_size + 1)]
        words = [wd for wd, c in zip(vocab, counts, strict=True) for _ in range(c)]
        random.Random(shuffle_seed).shuffle(words)
        return FWE_TEMPLATE.format(context=" ".join(words)), FWE_PREFIX, tuple(vocab[1:4])

    return build


def _builder(task: str, length: int, seed: int, haystack: str) -> Builder:
    if task in _NIAH:
        return _niah(task, seed, haystack)
    if task == "vt":
        return _vt(seed, haystack)
    if task == "cwe":
        return _cwe(seed, length)
    if task == "fwe":
        return _fwe(seed)
    raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")


def _min_units(task: str) -> int:
    # fwe: the 4th-ranked word must occur at least twice (n * 4**-2 / zeta(2) >= 2)
    return {"fwe": 64, "cwe": 1}.get(task, 1)


def _check(task: str, prompt: str, outputs: tuple[str, ...]) -> None:
    question = prompt.rsplit("\n", 1)[-1]
    if "\n" not in prompt or len(question) < 10 or len(question) > 400:
        raise AssertionError(f"{task}: the prompt's last line is not a question: {question[:80]!r}")
    for o in outputs:
        if o not in prompt:
            raise AssertionError(f"{task}: expected answer {o!r} is not in the prompt")
    if task == "fwe":
        counts = [len(re.findall(rf"(?<![a-z]){re.escape(o)}(?![a-z])", prompt)) for o in outputs]
        if min(counts) < 2:
            raise AssertionError(f"fwe: answers occur {counts} times")


def check_length_fits(task: str, length: int, count_tokens: Callable[[str, str], int], *, seed: int = 0,
                      haystack: str = DEFAULT_HAYSTACK, max_new_tokens: int | None = None,
                      samples: int = 1) -> list[tuple[str, str]]:
    """Refuse a ``length`` too small for ``task``'s smallest haystack in any of samples
    ``0 .. samples - 1`` (their keys and words differ in length), as :func:`make_sample` would,
    with one tokenization per sample instead of its whole search.

    Returns:
      each sample's ``(prompt, answer_prefix)`` at the smallest haystack: its question (the last
      line) and answer prefix are the sample's own, so setup B's decoded part can be measured
      from it without the search.

    Raises:
      ValueError: unknown task, or ``length`` too small (the message of :func:`make_sample`,
        naming the first sample that does not fit).
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    new = MAX_NEW_TOKENS[task] if max_new_tokens is None else int(max_new_tokens)
    smallest = []
    for index in range(samples):
        build = _builder(task, length, sample_seed(task, length, index, seed), haystack)
        _smallest_fits(task, length, new, build, count_tokens, index)
        smallest.append(tuple(build(_min_units(task))[:2]))
    return smallest


def _smallest_fits(task: str, length: int, new: int, build, count_tokens, index: int = 0) -> None:
    if count_tokens(*build(_min_units(task))[:2]) > length - new:
        raise ValueError(f"{task}: a context of {length} tokens (with {new} new tokens) is too small "
                         f"for the smallest haystack (sample {index})")


def make_sample(task: str, length: int, index: int, count_tokens: Callable[[str, str], int], *,
                seed: int = 0, haystack: str = DEFAULT_HAYSTACK, max_new_tokens: int | None = None) -> Sample:
    """Generate one sample whose prompt fills ``length - max_new_tokens`` tokens (RULER's sizing).

    The haystack size is the largest that fits: an exponential then a binary search on the
    number of units, each candidate prompt measured with ``count_tokens``. Everything
    random is drawn from :func:`sample_seed` ``(task, length, index, seed)``, so the same
    arguments give the same sample.

    Args:
      task: one of :data:`TASKS`.
      length: target context length in tokens (prompt + new tokens).
      index: sample index.
      count_tokens: ``count_tokens(prompt, answer_prefix) -> int``, the prompt's length in
        tokens as the model will see it (chat template applied).
      seed: base seed.
      haystack: prose source (see :mod:`magicpig_jax.eval.corpus`).
      max_new_tokens: decode budget (default :data:`MAX_NEW_TOKENS` of the task).

    Returns:
      a :class:`Sample`.

    Raises:
      ValueError: unknown task, or ``length`` too small for even the smallest haystack.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    new = MAX_NEW_TOKENS[task] if max_new_tokens is None else int(max_new_tokens)
    budget = length - new
    s = sample_seed(task, length, index, seed)
    build = _builder(task, length, s, haystack)
    _smallest_fits(task, length, new, build, count_tokens, index)
    lo = _min_units(task)
    hi = lo * 2
    while count_tokens(*build(hi)[:2]) <= budget:
        lo, hi = hi, hi * 2
        if hi > 10_000_000:
            raise ValueError(f"{task}: the haystack cannot reach {length} tokens")
    while hi - lo > 1:  # invariant: build(lo) fits, build(hi) does not
        mid = (lo + hi) // 2
        if count_tokens(*build(mid)[:2]) <= budget:
            lo = mid
        else:
            hi = mid
    prompt, prefix, outputs = build(lo)
    _check(task, prompt, outputs)
    return Sample(task=task, length=length, index=index, seed=s, prompt=prompt, answer_prefix=prefix,
                  outputs=outputs, max_new_tokens=new, units=lo)
