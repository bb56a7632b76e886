"""The results of ``magicpig-jax eval`` on disk: the crash-safe record file and the run's provenance.

In the output folder:

* ``results.jsonl``: one JSON record per (sample, method), appended and fsync'ed as soon as
  it is computed (:class:`ResultStore`); a partially written last line is dropped on load.
* ``config.json``: the settings fingerprint every record of the folder shares
  (:func:`check_fingerprint`); a run with other settings is refused.
* ``runs.jsonl``: one line per invocation: machine, wall time, records added
  (:func:`log_invocation`, :func:`read_runs`).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
import time
from pathlib import Path

__all__ = [
    "RESULTS",
    "record_key",
    "ResultStore",
    "machine_info",
    "check_fingerprint",
    "log_invocation",
    "read_runs",
]

RESULTS = "results.jsonl"


def record_key(rec: dict) -> tuple:
    """The identity of a record: (kind, task, length, index, method, setup).

    ``setup`` is the RULER setup of a task record (``"A"``: the question in the dense prefill,
    ``"B"``: decoded by the method after the document); records without one (likelihood
    records, and task records written before setups existed) count as ``"A"``.
    """
    return (rec["kind"], rec["task"], int(rec["length"]), int(rec["index"]), rec["method"], rec.get("setup", "A"))


class ResultStore:
    """The append-only JSONL results file, crash-safe.

    Loading drops a partially written last line (no trailing newline, or not valid JSON)
    by truncating the file to the last complete record; later duplicates of a key are
    ignored. Any other line that is not a record (invalid JSON before the last line, a
    value that is not an object, an object without a record's keys) is refused, naming
    the line: nothing is dropped or rewritten then. :meth:`append` writes one line,
    flushes and fsyncs it.

    Raises:
      ValueError: a line other than the last is not a record (its number is named).
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.records: dict[tuple, dict] = {}
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        keep = len(data)
        lines = data.split(b"\n")
        if data and not data.endswith(b"\n"):
            keep -= len(lines[-1])
            lines = lines[:-1]
        last = max((i for i, raw in enumerate(lines) if raw.strip()), default=-1)
        good = 0
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                good += len(raw) + 1
                continue
            try:
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                if number - 1 == last:  # a last line cut short: dropped, as a crash leaves it
                    keep = good
                    break
                raise ValueError(f"{self.path}: line {number} is not valid JSON ({err}); later lines hold "
                                 "records, so nothing is dropped: repair or remove that line") from None
            if not isinstance(rec, dict) or any(k not in rec for k in ("kind", "task", "length", "index", "method")):
                raise ValueError(f"{self.path}: line {number} is not a results record (an object with kind, task, "
                                 f"length, index and method): {raw[:80].decode(errors='replace')!r}")
            self.records.setdefault(record_key(rec), rec)
            good += len(raw) + 1
        if keep < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(keep)

    def __contains__(self, key: tuple) -> bool:
        return key in self.records

    def get(self, key: tuple) -> dict | None:
        return self.records.get(key)

    def append(self, rec: dict) -> None:
        """Write ``rec`` as one line, flushed and fsync'ed.

        Raises:
          RuntimeError: a record with the same :func:`record_key` is already stored.
        """
        key = record_key(rec)
        if key in self.records:
            raise RuntimeError(f"duplicate record {key}")
        line = json.dumps(rec, sort_keys=True) + "\n"
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        self.records[key] = rec


def machine_info() -> dict:
    """The machine a run happened on (for the results' provenance)."""
    import jax

    from magicpig_jax.eval.rss import cpu_model, source_revision

    return {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(),
            "jax": jax.__version__, "devices": [str(d) for d in jax.devices()], "cpu": cpu_model(),
            "source": source_revision()}


UNRECORDED = object()  # check_fingerprint's default of a key that older results files do not hold


def check_fingerprint(out: Path, fingerprint: dict, defaults: dict | None = None,
                      unread: frozenset[str] = frozenset()) -> None:
    """Pin ``fingerprint`` in ``out/config.json``, or check it against the one already there.

    Every key of either fingerprint is compared; a key one of them lacks counts as its value in
    ``defaults`` (a setting a fingerprint leaves out at its default), else as None, except that a
    key whose default is :data:`UNRECORDED` (one that older results files do not hold) is compared
    only where both hold it. Keys in ``unread`` (options no method of this run reads, e.g.
    ``budget_from`` without a budgeted baseline) are not compared: this run's records do not
    depend on them, and the folder keeps the values it recorded. The folder lists the keys that
    none of its runs has read yet (``config.json``'s ``unread``): they are not compared either,
    and the first run that reads one pins its value there.

    Raises:
      ValueError: ``out`` holds results of different settings (the message lists old and new values),
        or a ``results.jsonl`` without ``config.json`` (records of unknown settings).
    """
    defaults = defaults or {}
    cfg_path = Path(out) / "config.json"
    results = Path(out) / RESULTS
    if not cfg_path.exists() and results.exists() and results.read_bytes().strip():
        # the records' settings are unknown: pinning the new ones would label old records with them
        raise ValueError(f"{out} holds {results.name} but no config.json, so the settings of its records are "
                         "unknown; use another --out (or restore config.json)")
    if cfg_path.exists():
        cfg = json.loads(cfg_path.read_text())
        old, never_read = cfg.get("fingerprint", {}), set(cfg.get("unread", ()))
        keys = [k for k in sorted(set(old) | set(fingerprint))
                if k not in unread and k not in never_read
                and (defaults.get(k) is not UNRECORDED or (k in old and k in fingerprint))]
        diff = {k: (old.get(k, defaults.get(k)), fingerprint.get(k, defaults.get(k))) for k in keys
                if old.get(k, defaults.get(k)) != fingerprint.get(k, defaults.get(k))}
        if diff:
            raise ValueError(f"{out} holds results of other settings {diff} (old, new); use another --out")
        now_read = sorted(never_read - set(unread))
        if now_read:  # this run's records depend on them: pin this run's values
            for k in now_read:
                if k in fingerprint:
                    old[k] = fingerprint[k]
                else:
                    old.pop(k, None)
            _write_config(cfg_path, old, never_read & set(unread))
    else:
        _write_config(cfg_path, fingerprint, set(unread))


def _write_config(path: Path, fingerprint: dict, unread: set[str]) -> None:
    """``config.json``: the fingerprint, and the keys of it that no run has read yet."""
    cfg = {"fingerprint": fingerprint, **({"unread": sorted(unread)} if unread else {})}
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def log_invocation(out: Path, t_start: float, added: int, machine: dict | None = None) -> None:
    """Append one line to ``out/runs.jsonl``: start (UTC), wall seconds, records added, machine, argv.

    ``t_start`` is the invocation's start in ``time.time()`` seconds; ``machine`` the
    :func:`machine_info` taken as it started (default: now; a commit made during a run would be
    recorded as its source).

    Skipped when the invocation added nothing and took at most a second (a no-op rerun).
    """
    wall = time.time() - t_start
    if not added and wall <= 1:
        return
    entry = {"start": datetime.datetime.fromtimestamp(t_start, datetime.UTC).isoformat(timespec="seconds"),
             "wall_seconds": round(wall, 1), "records_added": added,
             "machine": machine if machine is not None else machine_info(),
             "argv": sys.argv}
    path = Path(out) / "runs.jsonl"
    _parse_runs(path, truncate=True)  # a line cut by a crash would swallow this one's start
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _parse_runs(path: Path, truncate: bool) -> list[dict]:
    if not path.exists():
        return []
    data = path.read_bytes()
    lines = data.split(b"\n")
    if not data.endswith(b"\n"):  # the last line was cut (or the file is empty): dropped
        cut, lines = lines[-1], lines[:-1]
    else:
        cut, lines = b"", lines[:-1]
    last = max((i for i, raw in enumerate(lines, start=1) if raw.strip()), default=0)
    runs = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            if number == last and not cut:  # the last line, whole but not JSON: cut short too
                cut = b"\n".join(lines[number - 1:]) + b"\n"
                break
            raise ValueError(f"{path}: line {number} is not valid JSON ({err}); repair or remove that line") from None
        if not isinstance(entry, dict):
            raise ValueError(f"{path}: line {number} is not an invocation entry (a JSON object)")
        runs.append(entry)
    if truncate and cut:
        with open(path, "r+b") as f:
            f.truncate(len(data) - len(cut))
    return runs


def read_runs(out: Path) -> list[dict]:
    """Every invocation logged in ``out/runs.jsonl`` (empty when there is none).

    A last line cut short (by a crash or an interrupt during the write) is skipped, as
    :class:`ResultStore` skips one; the next :func:`log_invocation` removes it.

    Raises:
      ValueError: a line other than the last is not a JSON object (its number is named).
    """
    return _parse_runs(Path(out) / "runs.jsonl", truncate=False)
