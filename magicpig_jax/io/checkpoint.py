"""Orbax checkpoints of a converted model: its weights as loaded, config, tokenizer.

A matrix that the source GGUF stores in one of :data:`magicpig_jax.io.gguf_blocks.QUANT_TYPES`
is saved as its raw GGUF rows (uint8, under :func:`magicpig_jax.io.gguf_model.packed_key`),
every other weight as float32, so a checkpoint holds each weight once, as the model does.

``magicpig-jax convert MODEL OUT`` writes one; ``load_model(OUT)`` reads it back
(faster than parsing a GGUF and its tokenizer).

Layout of ``OUT/``: ``magicpig_model.json`` (the :class:`LlamaConfig`, tokenizer
extras, format version), ``tokenizer.json`` (``tokenizers``), ``weights/`` (an
``orbax-checkpoint`` PyTree checkpoint of the Hugging Face-named weights).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

from magicpig_jax.io.json_files import read_json_object
from magicpig_jax.models.config import LlamaConfig

__all__ = ["save_checkpoint", "check_out_free", "leftover_partials", "read_checkpoint", "is_checkpoint",
           "checkpoint_files", "recorded_source", "MARKER"]

MARKER = "magicpig_model.json"
# 1: also a float32 copy of the Q4_1/Q8_0 matrices; 2: the config without ``sliding_layers``
# (both still readable, except a model with a sliding window: which layers it covers is not recorded);
# 3: without ``source_sha1`` (4 adds it: a version before 4 refuses the key, so it says so by the version);
# 4: without ``chat_templates`` (a model's named chat templates; 5 adds them)
# 5: without ``checksums`` (a CRC-32 of every byte of the weights and a SHA-256 of tokenizer.json; 6 adds
# them: ``weights_sha1`` samples pieces of each array, so a byte changed between them went unseen)
FORMAT_VERSION = 6
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6)
# The keys of MARKER that _write_checkpoint writes (earlier versions wrote a subset).
_META_KEYS = ("format_version", "config", "chat_template", "eos_token_ids", "bos_token_id", "eos_token_id",
              "add_bos_token", "add_eos_token", "template_tokens", "weights_sha1", "source_sha1", "chat_templates",
              "checksums")
# The version that first wrote each key (the others: 4 or earlier). From version 4 on every writer wrote
# every key of its version (source_sha1 only when given) and every LlamaConfig field, so a file of
# version 4 or later lacking one is edited or damaged: a default would stand in for what the model had.
_KEY_SINCE = {"chat_templates": 5, "checksums": 6}
_COMPLETE_SINCE = 4


def is_checkpoint(path: str | Path) -> bool:
    """True if ``path`` is a directory written by :func:`save_checkpoint`."""
    return (Path(path) / MARKER).is_file()


# orbax's bookkeeping beside the arrays (timestamps, the temporary path it was written to)
_ORBAX_BOOKKEEPING = ("_CHECKPOINT_METADATA", "commit_success.txt")


def recorded_source(path: str | Path) -> str | None:
    """The ``source_sha1`` that the checkpoint ``path`` records (the weights identity of the model it
    was converted from, :func:`magicpig_jax.io.digest.weights_identity`); None for another kind of
    model, or a checkpoint converted before it was recorded.

    Raises:
      ValueError: a ``magicpig_model.json`` that is not valid (as when the checkpoint is read).
    """
    path = Path(path)
    if not is_checkpoint(path):
        return None
    return _read_meta(path.absolute()).get("source_sha1")


def checkpoint_files(path: str | Path) -> list[Path]:
    """The files that identify the checkpoint ``path`` (what ``eval``'s model digest hashes).

    ``magicpig_model.json`` (which records ``weights_sha1``, the weights' digest, checked when
    they are read) and ``tokenizer.json``. orbax's array files are not listed: their names and
    bytes differ between two saves of the same arrays. A checkpoint written before
    ``weights_sha1`` lists its array files instead (orbax's bookkeeping left out), so converting
    such a model again changes its digest.

    Raises:
      FileNotFoundError: not a checkpoint directory.
    """
    path = Path(path)
    meta = _read_meta(path.absolute())
    files = [path / MARKER, path / "tokenizer.json"]
    if "weights_sha1" not in meta:
        files += sorted(p for p in (path / "weights").rglob("*") if p.is_file() and p.name not in _ORBAX_BOOKKEEPING)
    return files


def leftover_partials(out: str | Path) -> list[Path]:
    """Directories an interrupted :func:`save_checkpoint` to ``out`` left (beside ``out``, or inside
    an existing ``out``), or one running now; the caller may name them so that a user removes them."""
    out = Path(out).absolute()
    # exactly mkdtemp's names: its 8 random characters are [a-z0-9_]; a glob of out.name failed on a
    # name holding '**', missed one holding '[', and matched another OUT's ('m' took '.m.v2.*.partial')
    name = re.compile(rf"\.{re.escape(out.name)}\.[a-z0-9_]{{8}}\.partial")
    found = []
    for folder in (out.parent, out) if out.is_dir() else (out.parent,):
        try:
            found += [p for p in folder.iterdir() if name.fullmatch(p.name) and p.is_dir()]
        except OSError:  # absent, or not listable: nothing to name there (as the glob it replaced found)
            pass
    return sorted(found)


def check_out_free(out: str | Path) -> Path:
    """``out`` as an absolute path, if a checkpoint can be written there (it does not exist, or is an
    empty directory); :func:`save_checkpoint` checks it, and a caller checks it first to refuse
    before the heavy work of reading a source.

    Raises:
      FileExistsError: ``out`` already holds a checkpoint, or is not an empty directory (naming a
        leftover of an interrupted conversion inside it).
      ValueError: ``out``'s name is too long for the file system once the partial directory's
        affixes are added.
    """
    out = Path(out).absolute()
    if is_checkpoint(out):
        raise FileExistsError(f"{out} already holds a checkpoint; choose another OUT or remove it")
    # the conversion writes into '.{name}.XXXXXXXX.partial' first (save_checkpoint): its name must fit too
    folder = out if out.is_dir() else out.parent
    try:
        name_max = os.pathconf(folder, "PC_NAME_MAX") if folder.is_dir() else 255
    except (OSError, ValueError):
        name_max = 255
    extra = len(".") + len(".XXXXXXXX.partial")
    if len(os.fsencode(out.name)) + extra > name_max:
        raise ValueError(f"OUT's name {out.name[:40]!r}... is {len(os.fsencode(out.name))} bytes: the conversion "
                         f"writes into a directory named '.NAME.XXXXXXXX.partial' first, so NAME may have at most "
                         f"{name_max - extra} bytes here")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        left = [p.name for p in leftover_partials(out) if p.parent == out]
        hint = f" (it holds {left[0]}, from an interrupted conversion: remove it)" if left else ""
        raise FileExistsError(f"{out} exists and is not an empty directory{hint}; choose another OUT")
    return out


def save_checkpoint(out: str | Path, config: LlamaConfig, weights: dict[str, np.ndarray], tokenizer,
                    freq_factors: np.ndarray | None = None, verify=None, source_sha1: str | None = None) -> Path:
    """Write a converted model to the directory ``out`` (created; must not already hold a checkpoint).

    Args:
      out: destination directory.
      config: the model's :class:`LlamaConfig`.
      weights: Hugging Face-named ``(out, in)`` arrays: float (saved as float32), or uint8 GGUF
        rows under :func:`magicpig_jax.io.gguf_model.packed_key` (saved as they are).
      tokenizer: the :class:`magicpig_jax.io.tokenizer.Tokenizer`.
      freq_factors: optional RoPE frequency factors ``[D/2]``.
      verify: optional callable given the written directory before it is moved to ``out``; what it
        raises propagates and nothing is left at ``out`` (``convert_model`` loads the model with it).
      source_sha1: the weights identity of the model converted from
        (:func:`magicpig_jax.io.digest.weights_identity`), recorded when given.

    Returns:
      the directory.

    Raises:
      FileExistsError: ``out`` already holds a checkpoint, or is not an empty directory.
      TypeError: ``source_sha1`` is neither a str nor None.
      OSError: writing failed (a full disk, say; one line, and nothing is left behind).
      what ``verify`` raises.
    """

    if source_sha1 is not None and not isinstance(source_sha1, str):
        raise TypeError(f"source_sha1 must be a str (io.digest.weights_identity) or None, got {source_sha1!r}")
    out = check_out_free(out)
    # Written into a directory of this run's own (another run's, or a user's file, is never touched)
    # and moved when complete, so that an interrupted conversion leaves nothing that looks like a
    # checkpoint at ``out``. An existing empty ``out`` (a mount point, or in a read-only parent)
    # holds it, and receives its files, MARKER last; otherwise it is created beside ``out``.
    existing = out.exists()
    if not existing:
        out.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out if existing else out.parent))
    umask = os.umask(0)
    os.umask(umask)
    partial.chmod(0o777 & ~umask)  # mkdtemp's is 0700: a new OUT gets a directory's usual mode, as mkdir gives
    try:
        _write_checkpoint(partial, config, weights, tokenizer, freq_factors, source_sha1)
        if verify is not None:
            verify(partial)
        if existing:
            for item in sorted(partial.iterdir(), key=lambda p: p.name == MARKER):
                item.rename(out / item.name)
            partial.rmdir()
        else:
            partial.rename(out)
    except BaseException:
        _remove(partial)
        raise
    return out


def _remove(folder: Path, seconds: float = 5.0, quiet: float = 1.0) -> None:
    """Remove ``folder`` until it has stayed absent for ``quiet`` seconds (at most ``seconds``): after a
    failed write, orbax's pending writes create its folders again for a moment."""
    import shutil
    import time

    deadline = time.monotonic() + seconds
    absent_since = None
    while time.monotonic() < deadline:
        shutil.rmtree(folder, ignore_errors=True)
        if folder.exists():
            absent_since = None
        elif absent_since is None:
            absent_since = time.monotonic()
        elif time.monotonic() - absent_since >= quiet:
            return
        time.sleep(0.05)


def _write_checkpoint(out: Path, config: LlamaConfig, weights: dict, tokenizer, freq_factors,
                      source_sha1: str | None = None) -> None:
    import orbax.checkpoint as ocp

    for k in weights:
        # orbax's nested keys are the name's "."-separated parts (read back with "." again), and
        # "rope_freqs" holds the RoPE frequency factors: a name with "/", an empty part or that name
        # would come back as another weight, or as the factors (two names on one key: one dropped)
        if not isinstance(k, str) or not re.fullmatch(r"[^./]+(\.[^./]+)*", k) or k == "rope_freqs":
            raise ValueError(f"weight {k!r} cannot be stored in a checkpoint: a weight's name is non-empty "
                             "'.'-separated parts without '/', and 'rope_freqs' names the RoPE frequency factors "
                             "(a tensor the model does not use?)")
    # float weights as float32; raw GGUF blocks (uint8, see io.gguf_model.packed_key) as they are
    tree = {k.replace(".", "/"): np.asarray(v, np.uint8 if np.asarray(v).dtype == np.uint8 else np.float32)
            for k, v in weights.items()}
    if freq_factors is not None:
        tree["rope_freqs"] = np.asarray(freq_factors, np.float32)
    # A failed write (a full disk) is raised once, as one line: orbax also logs it through absl from each
    # of its threads, with tracebacks, and its pending writes report into its closed event loop
    import logging

    absl = logging.getLogger("absl")
    level = absl.level
    previous = _quiet_closed_loop_reports()
    absl.setLevel(logging.CRITICAL)
    try:
        with ocp.StandardCheckpointer() as ckpt:
            ckpt.save(out / "weights", tree)
    except (OSError, ValueError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OSError(f"writing the checkpoint's weights failed: {first[:300]}") from None
    finally:
        absl.setLevel(level)
    sys.unraisablehook = previous  # kept after a failure: the writes still pending report later
    tokenizer.backend.save(str(out / "tokenizer.json"))
    # orbax's files differ between two saves of the same arrays (random names, timestamps): this
    # names the weights for eval's model_sha1 (eval.settings.model_digest)
    import hashlib

    from magicpig_jax.io.digest import array_checksum, array_digest

    meta = {
        "format_version": FORMAT_VERSION,
        "config": dataclasses.asdict(config),
        "chat_template": tokenizer.chat_template,
        "chat_templates": tokenizer.chat_templates,
        "eos_token_ids": list(tokenizer.eos_token_ids),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "add_bos_token": tokenizer.add_bos_token,
        "add_eos_token": tokenizer.add_eos_token,
        "template_tokens": tokenizer.template_tokens,
        "weights_sha1": array_digest(tree),
        # the model it was converted from (io.digest.weights_identity), so that a file calibrated on
        # that model is known to fit this one (eval.calibrate.other_model_note)
        **({"source_sha1": source_sha1} if source_sha1 is not None else {}),
        # integrity: every byte of the weights (read_checkpoint checks it) and of tokenizer.json
        "checksums": {"weights_crc32": array_checksum(tree),
                      "tokenizer.json": hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()},
    }
    (out / MARKER).write_text(json.dumps(meta, indent=1))


def _read_meta(path: Path) -> dict:
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path} is not a magicpig_jax checkpoint (no {MARKER})")
    meta = read_json_object(path / MARKER)
    version = meta.get("format_version")
    if isinstance(version, bool) or version not in READABLE_VERSIONS:  # true == 1 in Python
        raise ValueError(f"unsupported checkpoint format_version {version!r} in {path}")
    unknown = sorted(set(meta) - set(_META_KEYS))
    if unknown:  # a setting added by hand would be ignored
        raise ValueError(f"checkpoint {path}: {MARKER} has unknown keys {unknown} (known: {', '.join(_META_KEYS)})")
    if not isinstance(meta.get("config"), dict):
        raise ValueError(f"checkpoint {path}: {MARKER} lacks its 'config' object")
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(meta["config"]) - fields)
    if unknown:
        raise ValueError(f"checkpoint {path}: its config has fields {unknown} that LlamaConfig does not have "
                         "(written by another version? convert the model again)")
    missing = sorted(fields - set(meta["config"]))
    if missing and version >= _COMPLETE_SINCE:  # these versions write every field
        raise ValueError(f"checkpoint {path}: its config lacks the fields {missing} (a default would stand in for "
                         "what the model had); convert the model again")
    written = {k for k in _META_KEYS if _KEY_SINCE.get(k, _COMPLETE_SINCE) <= version} - {"source_sha1"}
    missing = sorted(written - set(meta))
    if missing and version >= _COMPLETE_SINCE:  # these versions write them all: a default would stand in
        raise ValueError(f"checkpoint {path}: {MARKER} lacks the keys {missing}, which format_version "
                         f"{version} always writes (edited or damaged); convert the model again")
    _check_meta_types(path, meta)
    return meta


def _check_meta_types(path: Path, meta: dict) -> None:
    """Refuse tokenizer fields of the wrong JSON type (a hand-edited ``"false"`` would read as true)."""
    from magicpig_jax.io.tokenizer import TEMPLATE_TOKEN_NAMES

    def token_id(v) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    checks = {"add_bos_token": (lambda v: isinstance(v, bool), "true or false"),
              "add_eos_token": (lambda v: isinstance(v, bool), "true or false"),
              "bos_token_id": (lambda v: v is None or token_id(v), "a token id (int >= 0) or null"),
              "eos_token_id": (lambda v: v is None or token_id(v), "a token id (int >= 0) or null"),
              "eos_token_ids": (lambda v: isinstance(v, list) and all(map(token_id, v)), "a list of token ids"),
              "chat_template": (lambda v: v is None or isinstance(v, str), "a string or null"),
              "chat_templates": (lambda v: isinstance(v, dict) and all(isinstance(t, str) for t in v.values()),
                                 "an object mapping template names to Jinja sources"),
              "template_tokens": (lambda v: isinstance(v, dict) and all(
                  k in TEMPLATE_TOKEN_NAMES and isinstance(t, str) for k, t in v.items()),
                  f"an object mapping some of {', '.join(TEMPLATE_TOKEN_NAMES)} to token texts"),
              "weights_sha1": (lambda v: isinstance(v, str), "a string"),
              "source_sha1": (lambda v: isinstance(v, str), "a string"),
              "checksums": (lambda v: isinstance(v, dict) and set(v) == {"weights_crc32", "tokenizer.json"}
                            and all(isinstance(x, str) for x in v.values()),
                            "an object of the strings 'weights_crc32' and 'tokenizer.json'")}
    for key, (ok, allowed) in checks.items():
        if key in meta and not ok(meta[key]):
            raise ValueError(f"checkpoint {path}: {MARKER} '{key}' must be {allowed}, got {meta[key]!r}")
    cfg = meta["config"]
    scaling = cfg.get("rope_scaling")
    if scaling is not None and not (isinstance(scaling, list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in scaling)):
        raise ValueError(f"checkpoint {path}: {MARKER} config 'rope_scaling' must be a list of [key, value] "
                         f"pairs or null, got {scaling!r}")
    for key, nullable in (("sliding_layers", True), ("nope_layers", False)):
        v = cfg.get(key, [])
        if not ((nullable and v is None) or (isinstance(v, list) and all(token_id(i) for i in v))):
            allowed = "a list of layer indices" + (" or null" if nullable else "")
            raise ValueError(f"checkpoint {path}: {MARKER} config '{key}' must be {allowed}, got {v!r}")
    ids = cfg.get("eos_token_ids", [])
    if not (isinstance(ids, list) and all(map(token_id, ids))):
        raise ValueError(f"checkpoint {path}: {MARKER} config 'eos_token_ids' must be a list of token ids, "
                         f"got {cfg['eos_token_ids']!r}")


def _quiet_closed_loop_reports():
    """Drop, and only those, the reports of ``RuntimeError('Event loop is closed')``: when a restore
    fails, the store's reads still pending finish into orbax's closed event loop, each reported as
    an unraisable exception (a traceback per read, around the error). Returns the hook it replaced."""
    previous = sys.unraisablehook
    if getattr(previous, "_drops_closed_loop", False):
        return previous

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook._drops_closed_loop = True
    sys.unraisablehook = hook
    return previous


def _check_weight_dtypes(path: Path, tree: dict) -> None:
    """Refuse a weight of a dtype :func:`save_checkpoint` does not write (float32, or uint8 GGUF rows;
    the loader refuses uint8 under a key that is not a :func:`~magicpig_jax.io.gguf_model.packed_key`
    and a packed key that is not uint8): a cast would drop an imaginary part or a sign."""
    for key, value in tree.items():
        dtype = np.asarray(value).dtype
        if dtype not in (np.float32, np.uint8):
            raise ValueError(f"checkpoint {path}: weight {key.replace('/', '.')} is {dtype}, but checkpoints hold "
                             "float32 or uint8 (GGUF rows) (edited or damaged); convert the model again")


def read_checkpoint_config(path: str | Path) -> LlamaConfig:
    """The :class:`LlamaConfig` of a checkpoint, from its ``magicpig_model.json`` alone.

    Raises:
      FileNotFoundError: not a checkpoint directory.
      ValueError: an unknown format version, or an older one whose model has a sliding window; a
        field of the wrong type or out of range (a hand-edited file; named, with the checkpoint).
    """
    meta = _read_meta(Path(path).absolute())
    cfg = dict(meta["config"])
    if cfg.get("rope_scaling") is not None:
        # (key, value) pairs; LongRoPE's factor lists back to tuples (hashable, as the config holds them)
        cfg["rope_scaling"] = tuple((key, tuple(value) if isinstance(value, list) else value)
                                    for key, value in cfg["rope_scaling"])
    cfg["eos_token_ids"] = tuple(cfg.get("eos_token_ids", ()))
    if "sliding_layers" not in cfg and cfg.get("sliding_window") is not None:
        raise ValueError(f"checkpoint {path} (format_version {meta['format_version']}) has sliding_window "
                         f"{cfg['sliding_window']} but does not record which layers it applies to: convert the "
                         "model again (magicpig-jax convert)")
    if cfg.get("sliding_layers") is not None:
        cfg["sliding_layers"] = tuple(cfg["sliding_layers"])
    cfg["nope_layers"] = tuple(cfg.get("nope_layers", ()))
    try:
        return LlamaConfig(**cfg)
    except (TypeError, ValueError) as err:  # a hand-edited or damaged config: name the checkpoint
        raise ValueError(f"checkpoint {path}: {MARKER} config: {err}") from None


def read_checkpoint(path: str | Path):
    """Read a checkpoint written by :func:`save_checkpoint`.

    Returns:
      ``(config, weights, tokenizer, freq_factors)``.

    Raises:
      FileNotFoundError: not a checkpoint directory.
      ValueError: an unknown format version; a file of version 4 or later lacking a key or config
        field its version always writes; token ids outside the
        vocabulary; a damaged weights store; a weight of a dtype the writer does not write; weights
        or a tokenizer.json that do not match the recorded ``checksums`` (format 6: every byte), or
        weights that do not match the recorded ``weights_sha1`` (sampled pieces).
    """
    import orbax.checkpoint as ocp

    from magicpig_jax.io.tokenizer import Tokenizer, read_tokenizer_json

    path = Path(path).absolute()
    meta = _read_meta(path)
    config = read_checkpoint_config(path)
    for key in ("bos_token_id", "eos_token_id"):
        if meta.get(key) is not None and meta[key] >= config.vocab_size:
            raise ValueError(f"checkpoint {path}: {MARKER} '{key}' {meta[key]} is outside the model's vocabulary "
                             f"[0, {config.vocab_size})")
    for where, ids in (("'eos_token_ids'", meta.get("eos_token_ids", ())), ("config 'eos_token_ids'",
                                                                             config.eos_token_ids)):
        if any(i >= config.vocab_size for i in ids):
            raise ValueError(f"checkpoint {path}: {MARKER} {where} {list(ids)} has ids outside the model's "
                             f"vocabulary [0, {config.vocab_size})")
    previous = _quiet_closed_loop_reports()
    try:
        with ocp.StandardCheckpointer() as ckpt:
            tree = ckpt.restore(path / "weights")
    except (OSError, ValueError, RuntimeError, KeyError) as err:  # tensorstore's and orbax's, some very long
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ValueError(f"checkpoint {path}: its weights/ store is damaged or incomplete ({first[:200]}); "
                         "convert the model again") from None
    sys.unraisablehook = previous  # kept after a failure: the reads still pending report later
    _check_weight_dtypes(path, tree)
    if "checksums" in meta:
        import hashlib

        from magicpig_jax.io.digest import array_checksum

        found = {"weights_crc32": lambda: array_checksum({k: np.asarray(v) for k, v in tree.items()}),
                 # (a missing file is named by read_tokenizer_json below)
                 "tokenizer.json": lambda: hashlib.sha256((path / "tokenizer.json").read_bytes()).hexdigest()
                 if (path / "tokenizer.json").is_file() else meta["checksums"]["tokenizer.json"]}
        for key, recorded in meta["checksums"].items():
            if (got := found[key]()) != recorded:
                what = "weights" if key == "weights_crc32" else "tokenizer.json"
                raise ValueError(f"checkpoint {path}: {MARKER} records the checksum {key} {recorded}, but its {what} "
                                 f"give {got}: damaged or replaced; convert the model again")
    if "weights_sha1" in meta:
        from magicpig_jax.io.digest import array_digest

        found = array_digest({k: np.asarray(v) for k, v in tree.items()})
        if found != meta["weights_sha1"]:
            raise ValueError(f"checkpoint {path}: its weights do not match the weights_sha1 {meta['weights_sha1']} "
                             f"recorded in {MARKER} (found {found}): replaced or damaged; convert the model again")
    freq_factors = tree.pop("rope_freqs", None)
    weights = {k.replace("/", "."): np.asarray(v) for k, v in tree.items()}
    tokenizer = Tokenizer(read_tokenizer_json(path / "tokenizer.json", "a magicpig_jax checkpoint"),
                          chat_template=meta.get("chat_template"), eos_token_ids=meta.get("eos_token_ids", ()),
                          bos_token_id=meta.get("bos_token_id"), eos_token_id=meta.get("eos_token_id"),
                          add_bos_token=meta.get("add_bos_token", False),
                          add_eos_token=meta.get("add_eos_token", False),
                          template_tokens=meta.get("template_tokens"), chat_templates=meta.get("chat_templates"))
    return config, weights, tokenizer, None if freq_factors is None else np.asarray(freq_factors)
