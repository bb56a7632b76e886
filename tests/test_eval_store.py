"""magicpig_jax.eval.store: the crash-safe results file."""

from __future__ import annotations

import json
import time

import pytest

from magicpig_jax.eval.store import ResultStore, check_fingerprint, log_invocation, read_runs


def test_result_store_drops_corrupt_tail(tmp_path):
    p = tmp_path / "r.jsonl"
    good = {"kind": "task", "task": "vt", "length": 1, "index": 0, "method": "dense"}
    p.write_text(json.dumps(good) + "\n" + "{not json}\n" + json.dumps({**good, "index": 1}) + "\n")
    store = ResultStore(p)
    assert len(store.records) == 1 and p.read_text() == json.dumps(good) + "\n"
    store.append({**good, "index": 2})
    assert len(ResultStore(p).records) == 2
    with pytest.raises(RuntimeError, match="duplicate"):
        store.append(good)


def test_fingerprint_is_pinned_and_checked(tmp_path):
    check_fingerprint(tmp_path, {"seed": 0, "model": "m"})
    check_fingerprint(tmp_path, {"seed": 0, "model": "m"})  # the same settings: accepted
    with pytest.raises(ValueError, match=r"other settings \{'seed': \(0, 1\)\}"):
        check_fingerprint(tmp_path, {"seed": 1, "model": "m"})


def test_invocations_are_logged(tmp_path):
    assert read_runs(tmp_path) == []
    log_invocation(tmp_path, time.time(), 0)  # nothing added, under a second: not logged
    assert read_runs(tmp_path) == []
    log_invocation(tmp_path, time.time() - 5, 3)
    (run,) = read_runs(tmp_path)
    assert run["records_added"] == 3 and run["wall_seconds"] >= 5 and "jax" in run["machine"]
