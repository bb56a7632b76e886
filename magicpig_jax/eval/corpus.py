"""Offline text sources of the evaluation: word lists and real prose, all shipped by packages.

Nothing is downloaded at run time:

* **Words** — PyPI's ``wonderwords`` (the package RULER itself draws its words from,
  Hsieh et al., 2024, arXiv 2404.06654): its bundled noun, adjective and verb lists are
  read as package data (:func:`word_lists`); the package is a dependency of this project.
* **Prose** — two haystacks:

  - ``jargon``: Debian's ``jargon-text`` (the public-domain Jargon File 4.4.7, about
    400K tokens), read from ``/usr/share/doc/jargon-text/jargon.txt.gz``. Install it
    with ``make eval-data`` or ``apt-get install -y jargon-text`` (as root).
  - ``licenses``: the license texts in ``/usr/share/common-licenses`` (present on every
    Debian-family machine, about 70K tokens); the small in-suite configuration uses it.
  - ``licenses-heldout`` (the default of ``magicpig-jax eval``): ``licenses`` without
    the LGPL-2 and LGPL-2.1 files and without any paragraph of the bundled LGPL-2.1,
    the default calibration text of ``magicpig-jax calibrate``, so a calibrated file can
    be evaluated on it. SmolLM2-135M finds a needle in it at 4K and 8K tokens, which it
    does not do in the Jargon File (whose entries and ``{cross-references}`` it copies
    instead); see docs/evaluation.md.
  - any other value is a path to a UTF-8 text file (``.gz`` allowed).

Prose is cut into paragraphs (blank-line separated, whitespace collapsed); paragraphs of
fewer than :data:`MIN_PARAGRAPH_WORDS` words (headings, tables of contents, headwords)
are dropped; the rest is split into sentences, the units a haystack is built from and
between which needles are inserted (RULER inserts needles between sentences of Paul
Graham's essays).
"""

from __future__ import annotations

import functools
import gzip
import importlib.resources
import re
from pathlib import Path

__all__ = [
    "text_paragraphs",
    "JARGON_PATH",
    "LICENSES_DIR",
    "MIN_PARAGRAPH_WORDS",
    "HAYSTACKS",
    "DEFAULT_HAYSTACK",
    "CALIBRATION_TEXT",
    "word_lists",
    "load_prose",
    "load_sentences",
    "haystack_names",
]

JARGON_PATH = Path("/usr/share/doc/jargon-text/jargon.txt.gz")
LICENSES_DIR = Path("/usr/share/common-licenses")
MIN_PARAGRAPH_WORDS = 12
HAYSTACKS = ("jargon", "licenses", "licenses-heldout")
DEFAULT_HAYSTACK = "licenses-heldout"
# the bundled default calibration text of `magicpig-jax calibrate` (held out of licenses-heldout)
CALIBRATION_TEXT = Path(__file__).resolve().parent.parent / "data" / "lgpl-2.1.txt"

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'“‘(\[]?[A-Z0-9])")


@functools.cache
def word_lists() -> dict[str, tuple[str, ...]]:
    """``{"nouns", "adjectives", "verbs"}`` -> sorted unique lower-case words from ``wonderwords``.

    Only single words of letters are kept (no spaces, digits or punctuation), so that a
    word is never split by the hyphen of RULER's ``adjective-noun`` keys.

    Raises:
      FileNotFoundError: ``wonderwords`` is not installed (``pip install wonderwords``).
    """
    try:
        assets = importlib.resources.files("wonderwords") / "assets"
    except ModuleNotFoundError as err:
        raise FileNotFoundError("the word lists come from PyPI's wonderwords: pip install wonderwords") from err
    out = {}
    for key, name in (("nouns", "nounlist.txt"), ("adjectives", "adjectivelist.txt"), ("verbs", "verblist.txt")):
        words = (assets / name).read_text(encoding="utf-8").split("\n")
        out[key] = tuple(sorted({w.strip().lower() for w in words if re.fullmatch(r"[A-Za-z]+", w.strip())}))
    return out


def haystack_names() -> str:
    """Human-readable list of the accepted ``--haystack`` values."""
    return f"{', '.join(HAYSTACKS)} or a path to a text file"


def _read_text(path: Path) -> str:
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            return f.read()
    return path.read_text(encoding="utf-8", errors="replace")


def text_paragraphs(text: str) -> list[str]:
    """The paragraphs of ``text`` as a haystack file's are split (blank-line separated blocks,
    whitespace collapsed, of >= :data:`MIN_PARAGRAPH_WORDS` words)."""
    return _paragraphs([text])


def _paragraphs(texts: list[str]) -> list[str]:
    """Blank-line separated blocks, whitespace collapsed, of >= MIN_PARAGRAPH_WORDS words."""
    paragraphs = []
    for text in texts:
        for block in re.split(r"\n\s*\n", text):
            para = " ".join(block.split())
            if len(para.split(" ")) >= MIN_PARAGRAPH_WORDS:
                paragraphs.append(para)
    return paragraphs


@functools.cache
def load_prose(haystack: str | Path = DEFAULT_HAYSTACK) -> tuple[str, ...]:
    """The paragraphs of a haystack (see the module docstring), whitespace collapsed.

    Args:
      haystack: ``"jargon"``, ``"licenses"``, ``"licenses-heldout"`` or a path to a text file (a
        :class:`~pathlib.Path` is always a file, even one named like a haystack).

    Raises:
      FileNotFoundError: the source is missing; for ``jargon`` the message says how to install it.
      ValueError: the source has no paragraph of at least :data:`MIN_PARAGRAPH_WORDS` words.
    """
    held: set[str] = set()  # paragraphs left out (licenses-heldout: the calibration text's)
    named = not isinstance(haystack, Path)  # a str may name a haystack; a Path is a file
    if named and haystack == "jargon":
        if not JARGON_PATH.is_file():
            raise FileNotFoundError(
                f"{JARGON_PATH} not found: the 'jargon' haystack is Debian's jargon-text package; install it with "
                "`make eval-data` or `apt-get install -y jargon-text` (as root), or pass --haystack licenses"
            )
        texts = [_read_text(JARGON_PATH)]
    elif named and haystack in ("licenses", "licenses-heldout"):
        if not LICENSES_DIR.is_dir():
            raise FileNotFoundError(f"{LICENSES_DIR} not found (the {haystack!r} haystack); pass --haystack FILE")
        held_out = haystack == "licenses-heldout"
        seen, texts = set(), []
        for p in sorted(LICENSES_DIR.iterdir()):
            real = p.resolve()
            if held_out and real.name.startswith("LGPL-2"):
                continue
            if real.is_file() and real not in seen:  # GPL -> GPL-3 etc. are symlinks
                seen.add(real)
                texts.append(_read_text(real))
        if held_out:
            held = set(_paragraphs([_read_text(CALIBRATION_TEXT)]))
    else:
        path = Path(haystack)
        if not path.is_file():
            raise FileNotFoundError(f"haystack {haystack!r} is neither one of {HAYSTACKS} nor an existing file")
        try:  # the user's own text: bytes that are not UTF-8 are refused, not replaced
            texts = [path.read_bytes().decode("utf-8")]
        except UnicodeDecodeError as err:
            raise ValueError(f"haystack {haystack!r} is not UTF-8 text: byte {err.start} is "
                             f"0x{err.object[err.start]:02x}") from None
    paragraphs = [p for p in _paragraphs(texts) if p not in held]
    if not paragraphs:
        raise ValueError(f"haystack {haystack!r} has no paragraph of >= {MIN_PARAGRAPH_WORDS} words")
    return tuple(paragraphs)


@functools.cache
def load_sentences(haystack: str = DEFAULT_HAYSTACK) -> tuple[str, ...]:
    """The haystack's paragraphs split into sentences (a regex split after ``.``, ``!``, ``?``)."""
    out = []
    for para in load_prose(haystack):
        out.extend(s for s in _SENTENCE_END.split(para) if s)
    return tuple(out)
