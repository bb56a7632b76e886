"""magicpig_jax.eval.store: the crash-safe results file."""

from __future__ import annotations

import json
import time

import pytest

from magicpig_jax.eval.store import UNRECORDED, ResultStore, check_fingerprint, log_invocation, read_runs


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
    # a key one side leaves out counts as its default: in either order (a results folder written with
    # layers_per_projection 2 was resumed by a run at the default 1, which leaves the key out)
    for first, then in (({"lpp": 2}, {}), ({}, {"lpp": 2})):
        d = tmp_path / f"{len(first)}"
        d.mkdir()
        check_fingerprint(d, {"seed": 0, **first}, {"lpp": 1})
        with pytest.raises(ValueError, match="other settings"):
            check_fingerprint(d, {"seed": 0, **then}, {"lpp": 1})
        check_fingerprint(d, {"seed": 0, **first, "lpp": first.get("lpp", 1)}, {"lpp": 1})  # the default written out
    # a key older files lack (UNRECORDED) is compared only where both hold it
    d = tmp_path / "digest"
    d.mkdir()
    check_fingerprint(d, {"seed": 0}, {"digest": UNRECORDED})
    check_fingerprint(d, {"seed": 0, "digest": "abc"}, {"digest": UNRECORDED})  # an old folder, resumed
    (d / "config.json").write_text('{"fingerprint": {"seed": 0, "digest": "abc"}}')
    with pytest.raises(ValueError, match=r"other settings \{'digest': \('abc', 'abd'\)\}"):
        check_fingerprint(d, {"seed": 0, "digest": "abd"}, {"digest": UNRECORDED})  # the haystack changed
    # a key the new settings lack, with no default, counts as None: still refused
    with pytest.raises(ValueError, match=r"other settings \{'model': \('m', None\)\}"):
        check_fingerprint(tmp_path, {"seed": 0})


def test_invocations_are_logged(tmp_path):
    assert read_runs(tmp_path) == []
    log_invocation(tmp_path, time.time(), 0)  # nothing added, under a second: not logged
    assert read_runs(tmp_path) == []
    log_invocation(tmp_path, time.time() - 5, 3)
    (run,) = read_runs(tmp_path)
    assert run["records_added"] == 3 and run["wall_seconds"] >= 5 and "jax" in run["machine"]
