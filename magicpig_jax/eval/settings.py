"""The settings of ``magicpig-jax eval`` and their command-line options (see :mod:`magicpig_jax.eval.run`)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from magicpig_jax.argparsing import Parser, path_arg
from magicpig_jax.eval.corpus import DEFAULT_HAYSTACK, load_prose
from magicpig_jax.eval.methods import DEFAULT_METHODS, Method, parse_lengths, parse_methods
from magicpig_jax.eval.store import UNRECORDED

__all__ = ["EvalSettings", "SETUPS", "make_parser", "settings_from_args"]


@dataclasses.dataclass
class EvalSettings:
    """What to run (see :func:`make_parser` for the meaning of each field)."""

    tasks: list[str]
    lengths: list[int]
    samples: int
    methods: list[Method]
    haystack: str = DEFAULT_HAYSTACK
    seed: int = 0
    likelihood_tokens: int = 256
    likelihood_samples: int | None = None
    max_new_tokens: int | None = None
    num_sink: int = 4
    num_local: int = 64
    layers_per_projection: int = 1
    dense_layers: list[int] | None = None
    budget_from: str = "magicpig:10x150"
    page_size: int = 16
    setups: list[str] = dataclasses.field(default_factory=lambda: ["A", "B"])

    @property
    def likelihood_documents(self) -> int:
        """Likelihood documents per length: ``likelihood_samples``, or ``samples`` when it is None."""
        return self.samples if self.likelihood_samples is None else self.likelihood_samples

    def fingerprint(self, model) -> dict:
        """The settings every record of one results file must share."""
        from magicpig_jax.models.config import default_dense_layers

        n = model.config.num_layers
        dl = sorted(set(default_dense_layers(n) if self.dense_layers is None else self.dense_layers))
        out = {"model": str(model.source), "haystack": self.haystack, "seed": self.seed,
               "num_sink": self.num_sink, "num_local": self.num_local, "dense_layers": dl,
               "max_new_tokens": self.max_new_tokens, "likelihood_tokens": self.likelihood_tokens,
               "budget_from": self.budget_from, "page_size": self.page_size,
               "haystack_sha1": haystack_digest(self.haystack), "likelihood_starts": "distinct"}
        if Path(model.source).exists():  # (a model built in memory, as the tests' tiny one, has no files)
            out["model_sha1"] = model_digest(model.source)
        if self.layers_per_projection != 1:  # results files written before the option keep their fingerprint
            out["layers_per_projection"] = self.layers_per_projection
        if getattr(model.tokenizer, "add_bos_token", False):  # likelihood documents start with BOS (recorded
            out["likelihood_bos"] = True  # where it makes a difference, so that older folders keep theirs)
        return out


def haystack_digest(haystack: str) -> str:
    """SHA-1 (12 hex digits) of a haystack's paragraphs: its name or path alone does not pin its text
    (``licenses`` reads this machine's /usr/share/common-licenses; a FILE may change)."""
    import hashlib

    return hashlib.sha1("\n\n".join(load_prose(haystack)).encode()).hexdigest()[:12]


def model_digest(source, chunks: int = 64, chunk_bytes: int = 1 << 16) -> str:
    """SHA-1 (12 hex digits) identifying a model: its path alone does not pin it (a relative
    ``--model`` names another model from another folder; a file may be replaced in place).

    Hashes the files :func:`magicpig_jax.io.loader.model_files` lists (what the loader reads, so
    that bookkeeping beside a model changes nothing), each by its path relative to ``source``, its
    size and ``chunks`` evenly spaced pieces of ``chunk_bytes`` (a few MiB of a multi-GB file;
    :func:`magicpig_jax.io.digest.file_digest`). A checkpoint is named by the weights' digest that
    its ``magicpig_model.json`` records, as orbax's files differ between two saves of one model.

    Raises:
      OSError: a file cannot be read; FileNotFoundError, ValueError: as the loader, for a model
        whose weight files cannot be found.
    """
    import hashlib
    import os

    from magicpig_jax.io.digest import file_digest
    from magicpig_jax.io.loader import model_files

    root = Path(source)
    h = hashlib.sha1()
    for path in model_files(root):
        file_digest(h, path, os.path.relpath(path, root) if root.is_dir() else path.name, chunks, chunk_bytes)
    return h.hexdigest()[:12]


# The value of a setting that a fingerprint leaves out (store.check_fingerprint compares it so); the
# haystack's digest is compared only where both fingerprints hold it (results written before it).
# "likelihood_starts": absent from results written when each likelihood sample drew its start on its own
# (repeats possible); they are not resumed with the distinct starts of likelihood.likelihood_start.
# "model_sha1" (model_digest): compared only where both hold it, as the haystack's.
# "likelihood_bos": absent where the model adds no BOS, and from results written when the likelihood
# documents of a model that adds one were encoded without it (not resumed with BOS).
FINGERPRINT_DEFAULTS = {"layers_per_projection": 1, "haystack_sha1": UNRECORDED, "likelihood_starts": "independent",
                        "model_sha1": UNRECORDED, "likelihood_bos": False}


SETUPS = {"A": "the question is inside the dense prefill (the whole prompt is prefilled; the methods decode the "
                "answer)",
          "B": "the question is decoded by the method after the densely prefilled document (teacher-forced), "
                "then the answer"}


def make_parser() -> argparse.ArgumentParser:
    """The argument parser of ``magicpig-jax eval``."""
    from magicpig_jax.eval.tasks import TASKS

    p = Parser(prog="magicpig-jax eval", description="Long-context task accuracy and likelihood versus cost, per "
               "attention method: every method decodes from the same dense prefill of each sample.")
    p.add_argument("--tasks", default="niah_single,niah_multikey",
                   help=f"comma-separated tasks ({', '.join(TASKS)}; 'all', 'niah', or 'none' for likelihood only)")
    p.add_argument("--lengths", default="2K,4K,8K", help="context lengths in tokens (prompt + new tokens)")
    p.add_argument("--samples", type=int, default=20, help="samples per task, length and setup")
    p.add_argument("--setups", default="A,B",
                   help="RULER setups: A = the question inside the dense prefill, B = the question decoded by the "
                        "method after the document")
    p.add_argument("--magicpig-config", type=path_arg, default=None, action="append",
                   help="a per-layer configurations file of `magicpig-jax calibrate` (adds method magicpig@FILE; "
                        "repeatable)")
    p.add_argument("--methods", default=DEFAULT_METHODS,
                   help="comma-separated methods: dense; magicpig[:KxL] (10x150 alone); magicpig-ref[:KxL] (pure "
                        "JAX); hybrid:KxLxM; topk, quest, oracle (budget: the keys --budget-from sampled) or "
                        "topk:N, topk:FRACTION (likewise quest, oracle); topk-ref, quest-ref; magicpig@FILE (see "
                        f"--magicpig-config) (default: {DEFAULT_METHODS})")
    p.add_argument("--out", type=path_arg, required=True, help="output folder (results.jsonl, summary.md, PNGs)")
    p.add_argument("--model", default=None,
                   help="a .gguf file, a Hugging Face directory or an orbax checkpoint directory from "
                        "`magicpig-jax convert` (default: embedded SmolLM2)")
    p.add_argument("--haystack", default=DEFAULT_HAYSTACK,
                   help="prose: licenses-heldout (the default: /usr/share/common-licenses without calibrate's "
                        "LGPL-2.1), licenses (all of them), jargon (Debian jargon-text) or a text file")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the samples, of oracle sampling and of the SimHash projections of the "
                        "magicpig:KxL and hybrid methods (a magicpig@FILE method uses its file's, with which "
                        "it was calibrated)")
    p.add_argument("--likelihood-tokens", type=int, default=256,
                   help="teacher-forced prose tokens per likelihood sample (0 = no likelihood)")
    p.add_argument("--likelihood-samples", type=int, default=16, help="prose documents per length")
    p.add_argument("--max-new-tokens", type=int, default=None, help="new tokens for every task (default: per task)")
    p.add_argument("--num-sink", type=int, default=None, help="sink tokens kept exactly (default 4)")
    p.add_argument("--num-local", type=int, default=None, help="local window of the prompt kept exactly (default 64)")
    p.add_argument("--layers-per-projection", type=int, default=None,
                   help="consecutive layers sharing one SimHash projection matrix in the magicpig:KxL and hybrid "
                        "methods (default 1: one per layer; a magicpig@FILE method uses its file's)")
    p.add_argument("--dense-layers", default=None, help="layers kept dense (default: 0 and num_layers // 2)")
    p.add_argument("--budget-from", default=None,
                   help="MagicPIG method whose measured sampled count is the TopK/Quest/oracle budget (default "
                        "magicpig:10x150)")
    p.add_argument("--page-size", type=int, default=None,
                   help="Quest's page size, and the unit the measured budgets of topk, quest and oracle are "
                        "rounded to (default 16; 1 gives TopK exactly the keys MagicPIG sampled, rounded)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG plots")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bars")
    return p


_METHOD_DEFAULTS = {"num_sink": 4, "num_local": 64, "layers_per_projection": 1, "page_size": 16,
                    "budget_from": "magicpig:10x150"}


def option_readers(methods) -> dict[str, list]:
    """The methods of ``methods`` that read each method option (an option none reads changes no record)."""
    return {
        "num_sink": [m for m in methods if m.backend != "dense"],
        "num_local": [m for m in methods if m.backend != "dense"],
        "dense_layers": [m for m in methods if m.backend != "dense" and m.config_file is None],
        "layers_per_projection": [m for m in methods
                                  if m.backend in ("magicpig", "magicpig-ref", "hybrid") and m.config_file is None],
        # Quest's page, and the unit a measured budget is rounded to (run._budget_tokens)
        "page_size": [m for m in methods if m.backend == "quest" or (m.budgeted and m.budget is None)],
        "budget_from": [m for m in methods if m.budgeted and m.budget is None],
    }


def _check_options_used(methods, given: set[str]) -> None:
    """Refuse a method option that no method of ``--methods`` reads (it would be recorded yet change nothing)."""
    readers = option_readers(methods)
    what = {"num_sink": "a sparse method", "num_local": "a sparse method",
            "dense_layers": "a sparse method without a config file",
            "layers_per_projection": "magicpig:KxL, magicpig-ref or hybrid",
            "page_size": "quest, or topk / oracle at the measured budget",
            "budget_from": "topk, quest or oracle without their own budget"}
    unused = [f"--{name.replace('_', '-')} applies to {what[name]}, which --methods does not list" for name in readers
              if name in given and not readers[name]]
    if unused:  # all of them at once: fixing one at a time would take as many runs
        raise ValueError("; ".join(unused))


def settings_from_args(args) -> EvalSettings:
    """Validate parsed arguments into :class:`EvalSettings` (raises ValueError with the reason)."""
    from magicpig_jax.eval.tasks import parse_tasks

    given = {n for n, v in vars(args).items() if n in (*_METHOD_DEFAULTS, "dense_layers") and v is not None}
    for name, default in _METHOD_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    tasks = [] if args.tasks.strip().lower() == "none" else parse_tasks(args.tasks)
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if args.likelihood_tokens < 0 or (args.likelihood_samples is not None and args.likelihood_samples < 0):
        raise ValueError("--likelihood-tokens and --likelihood-samples must be >= 0")
    if not tasks and (args.likelihood_tokens == 0 or args.likelihood_samples == 0):
        zero = "--likelihood-tokens 0" if args.likelihood_tokens == 0 else "--likelihood-samples 0"
        raise ValueError(f"nothing to do: --tasks none and {zero}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    from magicpig_jax.attention.baselines import MAX_PAGE_SIZE

    if not 1 <= args.page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"--page-size must be in [1, {MAX_PAGE_SIZE}], got {args.page_size}")
    if args.layers_per_projection < 1:
        raise ValueError(f"--layers-per-projection must be >= 1, got {args.layers_per_projection}")
    setups = [x.strip().upper() for x in args.setups.split(",") if x.strip()]
    if not setups or any(x not in SETUPS for x in setups) or len(set(setups)) != len(setups):
        raise ValueError(f"--setups takes a comma-separated subset of A, B, got {args.setups!r}")
    methods = args.methods + "".join(f",magicpig@{p}" for p in (args.magicpig_config or []))
    dense_layers = None
    if args.dense_layers is not None:
        try:
            dense_layers = [int(x) for x in args.dense_layers.split(",") if x.strip()]
        except ValueError as err:
            raise ValueError(f"--dense-layers takes comma-separated integers, got {args.dense_layers!r}") from err
        if any(i < 0 for i in dense_layers):
            raise ValueError(f"--dense-layers must be layer indices >= 0, got {args.dense_layers!r}")
    from magicpig_jax.argparsing import in_flag_terms
    from magicpig_jax.attention import MagicPIGConfig

    with in_flag_terms(num_sink="--num-sink", num_local="--num-local", seed="--seed"):
        MagicPIGConfig(num_sink=args.num_sink, num_local=args.num_local, seed=args.seed)
    parsed = parse_methods(methods, args.budget_from)
    _check_options_used(parsed, given)
    return EvalSettings(tasks=tasks, lengths=parse_lengths(args.lengths), samples=args.samples,
                        methods=parsed, haystack=args.haystack, setups=setups,
                        seed=args.seed, likelihood_tokens=args.likelihood_tokens,
                        likelihood_samples=args.likelihood_samples, max_new_tokens=args.max_new_tokens,
                        num_sink=args.num_sink, num_local=args.num_local,
                        layers_per_projection=args.layers_per_projection, dense_layers=dense_layers,
                        budget_from=args.budget_from, page_size=args.page_size)
