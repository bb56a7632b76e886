"""magicpig_jax.eval.store: the crash-safe results file."""

from __future__ import annotations

import json
import time

import pytest

from magicpig_jax.eval.store import UNRECORDED, ResultStore, check_fingerprint, log_invocation, read_runs


def test_result_store_drops_only_a_corrupt_last_line(tmp_path):
    p = tmp_path / "r.jsonl"
    good = {"kind": "task", "task": "vt", "length": 1, "index": 0, "method": "dense"}
    for tail in ('{"kind": "ta', '{not json}\n'):  # cut short by a crash (with or without its newline)
        p.write_text(json.dumps(good) + "\n" + tail)
        store = ResultStore(p)
        assert len(store.records) == 1 and p.read_text() == json.dumps(good) + "\n"
    store.append({**good, "index": 2})
    assert len(ResultStore(p).records) == 2
    with pytest.raises(RuntimeError, match="duplicate"):
        store.append(good)


@pytest.mark.parametrize(("bad", "named"), [
    ("{not json}", "line 2 is not valid JSON"),
    ("[1, 2]", "line 2 is not a results record"),
    ('{"foo": 1}', "line 2 is not a results record"),
])
def test_a_bad_line_before_the_last_is_refused_and_nothing_is_dropped(tmp_path, bad, named):
    """A bad middle line used to cut the file there, deleting every valid record after it
    silently (and a record without its keys raised KeyError)."""
    p = tmp_path / "r.jsonl"
    good = {"kind": "task", "task": "vt", "length": 1, "index": 0, "method": "dense"}
    text = json.dumps(good) + "\n" + bad + "\n" + json.dumps({**good, "index": 1}) + "\n"
    p.write_text(text)
    with pytest.raises(ValueError, match=named):
        ResultStore(p)
    assert p.read_text() == text


def test_results_without_their_config_are_not_given_new_settings(tmp_path):
    """A folder whose config.json was lost took the new run's settings as its records' own."""
    (tmp_path / "results.jsonl").write_text('{"kind": "task"}\n')
    with pytest.raises(ValueError, match="results.jsonl but no config.json"):
        check_fingerprint(tmp_path, {"seed": 7})
    assert not (tmp_path / "config.json").exists()


def test_options_no_listed_method_reads_are_not_compared(tmp_path):
    """A folder of dense + budgeted TopK could not take MagicPIG alone: budget_from was compared,
    and --budget-from was refused as unused."""
    check_fingerprint(tmp_path, {"seed": 0, "budget_from": "magicpig:8x75"})
    with pytest.raises(ValueError, match="budget_from"):
        check_fingerprint(tmp_path, {"seed": 0, "budget_from": "magicpig:10x150"})
    check_fingerprint(tmp_path, {"seed": 0, "budget_from": "magicpig:10x150"}, unread=frozenset({"budget_from"}))
    assert json.loads((tmp_path / "config.json").read_text())["fingerprint"]["budget_from"] == "magicpig:8x75"


def test_the_model_digest_tells_models_apart_whatever_their_path(tmp_path):
    """A relative --model named another model from another folder and reused its records."""
    import shutil
    from pathlib import Path

    from magicpig_jax.eval.settings import model_digest

    families = Path(__file__).parent / "fixtures" / "families"
    shutil.copytree(families / "llama3", tmp_path / "a" / "model")
    shutil.copytree(families / "qwen2", tmp_path / "b" / "model")
    shutil.copytree(families / "llama3", tmp_path / "c")
    a, b = model_digest(tmp_path / "a" / "model"), model_digest(tmp_path / "b" / "model")
    assert a != b and a == model_digest(tmp_path / "c")
    big = tmp_path / "big.gguf"  # sampled pieces of a large file: one changed byte in a piece is seen
    data = bytearray(range(256)) * (1 << 14)
    big.write_bytes(bytes(data))
    before = model_digest(big, chunks=4, chunk_bytes=1024)
    data[len(data) - 1] ^= 1
    big.write_bytes(bytes(data))
    assert model_digest(big, chunks=4, chunk_bytes=1024) != before


def test_the_model_digest_ignores_bookkeeping_beside_the_model(tmp_path):
    """Re-converting a model, hf download's timestamps, git's files or a results folder inside
    the model folder made an unchanged model's records unresumable."""
    import shutil
    from pathlib import Path

    from magicpig_jax.eval.settings import model_digest
    from magicpig_jax.io.loader import convert_model

    families = Path(__file__).parent / "fixtures" / "families"
    hf = tmp_path / "hf"
    shutil.copytree(families / "llama3", hf)
    before = model_digest(hf)
    (hf / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (hf / ".cache" / "huggingface" / "download" / "model.safetensors.metadata").write_text("1765000000.0")
    (hf / ".git").mkdir()
    (hf / ".git" / "FETCH_HEAD").write_text("abc")
    (hf / "runs").mkdir()
    (hf / "runs" / "results.jsonl").write_text("{}\n")
    (hf / "README.md").write_text("a model card")
    for unread in ("params.json", "consolidated.safetensors"):  # no loader reads them
        (hf / unread).write_text("{}")
    assert model_digest(hf) == before
    (hf / "special_tokens_map.json").write_text("{}")  # the tokenizer reads it (its named special tokens)
    assert model_digest(hf) != before
    (hf / "special_tokens_map.json").unlink()
    config = json.loads((hf / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6
    (hf / "config.json").write_text(json.dumps(config))
    assert model_digest(hf) != before

    one = convert_model(families / "llama3", tmp_path / "one")
    two = convert_model(families / "llama3", tmp_path / "two")  # orbax's files differ between the two
    other = convert_model(hf, tmp_path / "other")  # only rms_norm_eps differs
    assert model_digest(one) == model_digest(two) != model_digest(other)
    weights = shutil.copytree(families / "llama3", tmp_path / "w")
    data = bytearray((weights / "model.safetensors").read_bytes())
    data[-1] ^= 1  # the last byte of the last tensor: a piece every array digest reads
    (weights / "model.safetensors").write_bytes(bytes(data))
    assert model_digest(convert_model(weights, tmp_path / "three")) != model_digest(one)


def test_the_model_digest_follows_the_weights_the_loader_reads(tmp_path):
    """An index placing the shards in a subfolder; weights changed with nothing else; a checkpoint
    written before weights_sha1; a checkpoint's weights replaced in place."""
    import shutil
    from pathlib import Path

    from safetensors.numpy import load_file, save_file

    from magicpig_jax.eval.settings import model_digest
    from magicpig_jax.io.checkpoint import MARKER, read_checkpoint
    from magicpig_jax.io.loader import convert_model

    families = Path(__file__).parent / "fixtures" / "families"
    hf = shutil.copytree(families / "llama3", tmp_path / "hf")
    tensors = load_file(hf / "model.safetensors")
    (hf / "model.safetensors").unlink()
    (hf / "shards").mkdir()
    save_file(tensors, hf / "shards" / "model-00001-of-00001.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {name: "shards/model-00001-of-00001.safetensors" for name in tensors}}))
    before = model_digest(hf)
    save_file({k: v * 2 for k, v in tensors.items()}, hf / "shards" / "model-00001-of-00001.safetensors")
    assert model_digest(hf) != before

    one = convert_model(families / "llama3", tmp_path / "one")
    two = convert_model(hf, tmp_path / "two")  # the same config and tokenizer, other weights
    assert model_digest(one) != model_digest(two)
    for ckpt in (one, two):  # as written before weights_sha1: identified by orbax's array files
        meta = json.loads((ckpt / MARKER).read_text())
        for key in ("weights_sha1", "source_sha1", "chat_templates", "checksums"):
            del meta[key]
        meta["format_version"] = 3  # format 4 and later always write weights_sha1: a file without it is refused
        (ckpt / MARKER).write_text(json.dumps(meta))
    assert model_digest(one) != model_digest(two)
    read_checkpoint(one)  # still readable

    three = convert_model(families / "llama3", tmp_path / "three")
    four = convert_model(hf, tmp_path / "four")
    shutil.rmtree(three / "weights")
    shutil.copytree(four / "weights", three / "weights")
    with pytest.raises(ValueError, match="records the checksum weights_crc32 .*, but its weights give"):
        read_checkpoint(three)


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


def test_an_option_no_run_has_read_is_pinned_by_the_first_run_that_reads_it(tmp_path):
    """A folder of dense,magicpig (budget_from unread) refused a later topk --budget-from magicpig:4x8,
    though no record depended on the value first written."""
    check_fingerprint(tmp_path, {"seed": 0, "budget_from": "magicpig:10x150"}, unread=frozenset({"budget_from"}))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["unread"] == ["budget_from"]
    check_fingerprint(tmp_path, {"seed": 0, "budget_from": "magicpig:4x8"})  # read now: pinned
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg == {"fingerprint": {"seed": 0, "budget_from": "magicpig:4x8"}}
    with pytest.raises(ValueError, match="budget_from"):
        check_fingerprint(tmp_path, {"seed": 0, "budget_from": "magicpig:10x150"})
    with pytest.raises(ValueError, match="seed"):  # what was read stays compared
        check_fingerprint(tmp_path, {"seed": 1, "budget_from": "magicpig:4x8"}, unread=frozenset({"budget_from"}))


def test_a_cut_last_invocation_line_is_skipped_and_removed_by_the_next_log(tmp_path):
    """An interrupt during the write left a cut last line in runs.jsonl: every later summary of the
    folder failed on it (JSONDecodeError), and the next entry was appended to the fragment."""
    log_invocation(tmp_path, time.time() - 5, 3)
    path = tmp_path / "runs.jsonl"
    whole = path.read_bytes()
    for cut in (b'{"start": "2026-', b'{"start": "2026-\n', b'{"start": "2026-\n\n'):
        path.write_bytes(whole + cut)
        assert len(read_runs(tmp_path)) == 1 and path.read_bytes() == whole + cut  # reading changes nothing
        log_invocation(tmp_path, time.time() - 5, 2)
        assert [r["records_added"] for r in read_runs(tmp_path)] == [3, 2]
        assert path.read_bytes().startswith(whole) and path.read_bytes().count(b"\n") == 2
    path.write_bytes(whole + b"not json\n" + whole)
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        read_runs(tmp_path)
    path.write_bytes(whole + b"[1, 2]\n")
    with pytest.raises(ValueError, match="line 2 is not an invocation entry"):
        read_runs(tmp_path)
