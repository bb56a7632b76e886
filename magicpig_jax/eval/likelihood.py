"""Long-text likelihood: teacher-forced decoding of real prose, each method against dense.

A sample is ``length`` tokens of real prose (no chat template). The first
``length - n`` tokens are prefilled densely once; the last ``n`` tokens (256 by default)
are then *teacher-forced* through :func:`magicpig_jax.eval.forcing.forced_decode` with each
attention method (``forced_tokens=``), and ``logits_callback=`` collects the next-token
distribution at every forced position. This measures the decode-time approximation alone:
prefill is dense and shared, as in MagicPIG (arXiv 2410.16179, Section 4.3, "prefill is
dense"; the paper's own quality metric on perplexity-like tasks is in Section 5.1).

Metrics of a method ``m`` over the ``n`` forced positions (natural logs):

* ``nll``: mean ``-log p_m(x_t | x_<t)`` of the true next token; ``ppl = exp(nll)``;
* ``kl``: mean ``KL(p_dense || p_m) = sum_v p_dense(v) (log p_dense(v) - log p_m(v))``, the
  divergence of the method's next-token distribution from dense (0 for dense itself);
* ``top1``: fraction of positions where ``argmax p_m == argmax p_dense``.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

import numpy as np

from magicpig_jax.eval.corpus import DEFAULT_HAYSTACK, load_prose
from magicpig_jax.eval.tasks import sample_seed

__all__ = ["LikelihoodSample", "likelihood_start", "make_likelihood_sample", "document_encoder", "log_softmax",
           "LogitsRecorder", "compare_to_dense"]


@dataclasses.dataclass(frozen=True)
class LikelihoodSample:
    """``length`` token ids of prose; the last ``forced`` are teacher-forced.

    Attributes:
      length, index, seed: identification (``seed`` from :func:`sample_seed`).
      ids: the ``length`` token ids.
      forced: number of teacher-forced tokens at the end.
      paragraph: index of the first paragraph used.
    """

    length: int
    index: int
    seed: int
    ids: tuple[int, ...]
    forced: int
    paragraph: int

    @property
    def prefix(self) -> list[int]:
        """The densely prefilled ids."""
        return list(self.ids[: self.length - self.forced])

    @property
    def targets(self) -> list[int]:
        """The teacher-forced ids."""
        return list(self.ids[self.length - self.forced:])


def likelihood_start(num_paragraphs: int, length: int, index: int, seed: int = 0) -> int:
    """The first paragraph of likelihood sample ``index``: entry ``index mod P`` of a permutation of
    the ``P = num_paragraphs`` paragraphs seeded by ``(length, seed)``.

    Drawing each sample's start on its own repeated starts (16 draws from 476 paragraphs repeat
    one about every fifth time), i.e. identical documents counted as independent samples; a
    permutation gives distinct starts to the first P samples of a length. Long documents of a
    small corpus still overlap in text (their starts differ).

    Raises:
      ValueError: ``num_paragraphs < 1`` or ``index < 0``.
    """
    if num_paragraphs < 1 or index < 0:
        raise ValueError(f"need num_paragraphs >= 1 and index >= 0, got {num_paragraphs}, {index}")
    order = list(range(num_paragraphs))
    random.Random(sample_seed("likelihood-starts", length, 0, seed)).shuffle(order)
    return order[index % num_paragraphs]


def document_encoder(tokenizer) -> Callable[[str], list[int]]:
    """text -> token ids of a document as the model reads one: BOS first where the tokenizer adds
    one (``add_bos_token``: Llama, Mistral, Gemma, Phi-3), never EOS (the text continues past the
    cut). Without BOS such a model reads out-of-distribution input and its first prose token
    becomes the attention sink. A :class:`~magicpig_jax.io.tokenizer.Tokenizer`'s ``encode``."""

    def encode(text: str) -> list[int]:
        ids = tokenizer.encode(text)
        if tokenizer.add_bos_token and (not ids or ids[0] != tokenizer.bos_token_id):
            ids = [tokenizer.bos_token_id, *ids]
        return ids

    return encode


def make_likelihood_sample(encode: Callable[[str], list[int]], length: int, index: int, *, seed: int = 0,
                           haystack: str = DEFAULT_HAYSTACK, forced: int = 256) -> LikelihoodSample:
    """Real prose of exactly ``length`` tokens, starting at a seeded paragraph.

    Paragraphs (see :func:`magicpig_jax.eval.corpus.load_prose`) are joined with blank lines,
    from the paragraph :func:`likelihood_start` gives (distinct for the first P indices of a
    length and seed: no two samples are the same text), wrapping around the corpus, until the
    text has at least ``length`` tokens; the ids are cut to ``length``.

    Args:
      encode: text -> token ids (no chat template; :func:`document_encoder` gives the model's BOS).
      length: tokens in the sample.
      index, seed: sample identification.
      haystack: prose source.
      forced: teacher-forced tokens at the end (``1 <= forced < length``).

    Raises:
      ValueError: ``forced`` or ``length`` not an int, ``forced`` out of range, or the corpus is
        shorter than ``length`` tokens.
    """
    for name, value in (("forced", forced), ("length", length)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if not 1 <= forced < length:
        raise ValueError(f"need 1 <= forced < length, got forced={forced}, length={length}")
    paras = load_prose(haystack)
    s = sample_seed("likelihood", length, index, seed)
    start = likelihood_start(len(paras), length, index, seed)
    text, ids = "", []
    for i in range(len(paras)):
        text += ("\n\n" if text else "") + paras[(start + i) % len(paras)]
        if len(text) >= 2 * length or i == len(paras) - 1:  # cheap check first, then tokenize
            ids = encode(text)
            if len(ids) >= length:
                break
    if len(ids) < length:
        raise ValueError(f"haystack {haystack!r} has fewer than {length} tokens")
    return LikelihoodSample(length=length, index=index, seed=s, ids=tuple(ids[:length]), forced=forced,
                            paragraph=start)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Natural-log softmax over the last axis, in float64."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


class LogitsRecorder:
    """A ``logits_callback`` for :func:`~magicpig_jax.eval.forcing.forced_decode`: float32 log-probabilities of row 0.

    After decoding ``n`` forced tokens, :attr:`logp` is ``[n, V]`` (position t predicts
    forced token t).
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.rows: list[np.ndarray | None] = [None] * n

    def __call__(self, step: int, logits: np.ndarray) -> None:
        if 0 <= step < self.n:
            self.rows[step] = log_softmax(np.asarray(logits)[0]).astype(np.float32)

    @property
    def logp(self) -> np.ndarray:
        missing = [i for i, r in enumerate(self.rows) if r is None]
        if missing:
            raise RuntimeError(f"no logits recorded at steps {missing[:5]}...")
        return np.stack(self.rows)  # type: ignore[arg-type]


def compare_to_dense(logp: np.ndarray, logp_dense: np.ndarray, targets: Sequence[int]) -> dict:
    """NLL, perplexity, mean KL(dense || method) and top-1 agreement (see the module docstring).

    Args:
      logp: ``[n, V]`` float log-probabilities of the method (nats; ``-inf`` for a token it rules out).
      logp_dense: ``[n, V]`` float log-probabilities of dense attention.
      targets: the ``n`` true next tokens, integer ids in ``[0, V)``.

    Returns:
      ``{"nll", "ppl", "kl", "kl_max", "top1"}`` (floats; nats for ``nll`` and the KLs). A token
      dense rules out (``-inf``) adds nothing to the KL (``0 log 0 = 0``); one the method rules out
      where dense does not makes it ``inf``. Top-1 ties go to the lowest id (``argmax``).

    Raises:
      ValueError: shapes that are not ``[n, V]``, ``[n, V]`` and ``[n]`` with ``n >= 1``; a NaN in
        either log-probability array (a top-1 agreement would still read as measured); a target
        that is not an integer in ``[0, V)`` (-1 had read the last token's probability).
    """
    lp = np.asarray(logp, np.float64)
    ld = np.asarray(logp_dense, np.float64)
    t = np.asarray(targets)
    if lp.ndim != 2 or lp.shape != ld.shape or t.shape != (lp.shape[0],) or lp.shape[0] == 0:
        raise ValueError(f"logp, logp_dense and targets must be [n, V], [n, V] and [n] with n >= 1, got "
                         f"{lp.shape}, {ld.shape} and {t.shape}")
    for name, x in (("logp", lp), ("logp_dense", ld)):
        if np.isnan(x).any():
            raise ValueError(f"{name} holds NaN at row {int(np.isnan(x).any(axis=-1).argmax())}")
    V = lp.shape[1]
    if t.dtype.kind not in "iu" or ((t < 0) | (t >= V)).any():
        raise ValueError(f"targets must be integer token ids in [0, {V}), got {t.dtype} {t.tolist()[:8]}")
    nll = float(-lp[np.arange(t.shape[0]), t].mean())
    # a token dense rules out adds 0; one only the method rules out adds inf, even where dense's
    # probability underflows to 0 (exp(-800) * inf would be NaN); elsewhere lp is finite
    dense_out, method_out = np.isneginf(ld), np.isneginf(lp)
    finite = ~dense_out & ~method_out
    with np.errstate(invalid="ignore"):  # -inf - -inf, masked out below
        diff = np.where(finite, ld - lp, 0.0)
    terms = np.where(finite, np.exp(ld) * diff, np.where(dense_out, 0.0, np.inf))
    kl_t = terms.sum(axis=-1)
    kl_t = np.maximum(kl_t, 0.0)  # rounding can give -1e-12
    top1 = float((lp.argmax(-1) == ld.argmax(-1)).mean())
    return {"nll": nll, "ppl": float(np.exp(nll)), "kl": float(kl_t.mean()), "kl_max": float(kl_t.max()),
            "top1": top1}
