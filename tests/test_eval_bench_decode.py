"""magicpig_jax.eval.bench_decode: batched throughput of dense and MagicPIG on a tiny model (structure of
the JSON, medians with their spread, one prefill broadcast to B rows, peak RSS per configuration)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from magicpig_jax.eval import bench_decode
from magicpig_jax.models.cache import KVCache, RowBroadcast
from tests._tiny import TINY, tiny_model


def test_row_broadcast_copies_one_row_to_b_fresh_rows():
    import jax.numpy as jnp

    cache = KVCache.zeros(TINY, 2, 8)
    cache = KVCache(k=tuple(x.at[1].set(1.0) for x in cache.k), v=cache.v, lengths=jnp.asarray([3, 5], jnp.int32))
    wide = RowBroadcast(cache, 4, row=1)
    assert wide.capacity == 8 and np.asarray(wide.lengths).tolist() == [5] * 4
    c = wide.copy()
    assert c.k[0].shape == (4, TINY.num_kv_heads, 8, TINY.head_dim)
    assert np.all(np.asarray(c.k[2]) == 1.0) and np.asarray(c.lengths).tolist() == [5] * 4
    one = cache.broadcast_rows(1)  # never an alias: donating it leaves the source intact
    assert one.k[0].unsafe_buffer_pointer() != cache.k[0].unsafe_buffer_pointer()
    with pytest.raises(ValueError):
        cache.broadcast_rows(2, row=2)


@pytest.mark.slow
def test_bench_decode_tiny(tmp_path, monkeypatch):
    import magicpig_jax.io.loader as loader

    monkeypatch.setattr(loader, "load_model", lambda path=None: tiny_model(0))
    monkeypatch.setattr(bench_decode, "prompt_ids", lambda model, text, n: [(7 * i) % 90 + 1 for i in range(n)])
    import magicpig_jax.memory as memory

    # the shapes earlier tests of this worker recorded would make the prefill's own retention drop
    # (memory.note_program_shape) count here: start from none, whatever ran before
    memory.drop_compiled_programs()
    events = []
    drop, reset = memory.drop_compiled_programs, bench_decode.PeakRSS.reset
    monkeypatch.setattr(memory, "drop_compiled_programs", lambda: (events.append("drop"), drop())[1])
    monkeypatch.setattr(bench_decode.PeakRSS, "reset", lambda self: (events.append("reset"), reset(self))[1])
    out = tmp_path / "bench"
    assert bench_decode.main(["--lengths", "300", "--batch", "1", "3", "--steps", "3", "--repeats", "3",
                              "--warmup", "0", "--text", __file__, "--out", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 0
    res = {(r["batch"], r["method"]): r for r in data["results"]}
    assert set(res) == {(1, "dense"), (3, "dense"), (1, "magicpig"), (3, "magicpig")}
    for (B, method), r in res.items():
        for key in ("ms_per_step", "tokens_per_s"):
            s = r[key]
            assert len(s["values"]) == 3 and s["min"] <= s["median"] <= s["max"]
        assert r["tokens_per_s"]["median"] == pytest.approx(1000.0 * B / r["ms_per_step"]["median"])
        assert r["rows_identical"] and len(r["tokens"]) == 4 and r["prompt_tokens"] == 300
        assert r["peak_rss_bytes"] > 0
        assert (r["sampled_fraction"] is None) == (method == "dense")
    # Same greedy tokens for every B (one prompt copied to B rows); the first token comes from the
    # prefill, so it is the same for every method.
    assert res[(3, "dense")]["tokens"] == res[(1, "dense")]["tokens"]
    assert res[(3, "magicpig")]["tokens"] == res[(1, "magicpig")]["tokens"]
    assert 1 <= res[(3, "magicpig")]["tokens_equal_to_dense"] <= 4
    ratio = {(r["prompt_tokens"], r["batch"]): r for r in data["ratios"]}
    assert ratio[(300, 3)]["magicpig_over_dense"] > 0
    assert data["meta"]["repeats"] == 3
    from importlib.metadata import version

    assert (data["meta"]["jax"], data["meta"]["jaxlib"]) == (version("jax"), version("jaxlib"))
    # the commit the figures came from (this checkout's HEAD; "-dirty" with edited tracked files)
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    if head:  # a git checkout (CI's clean clone)
        assert data["meta"]["source"].removesuffix("-dirty").startswith(head), (data["meta"]["source"], head)
    else:  # an sdist, or git refuses the folder
        assert data["meta"]["source"] == "unknown"
    assert data["meta"]["cpu"]
    # every configuration frees the earlier ones' compiled programs before its peak is measured
    assert events == ["drop", "reset"] * 4


def test_even_repeats_give_one_median_and_the_text_input_is_not_overwritten(tmp_path, capsys):
    """With 4 repeats the median of the tokens/s values differed from B x 1000 / the ms median (130.552 and
    130.536 in a reviewer's run), so a row's ms_per_token and ratios disagreed; and --out could name the
    --text input's file and overwrite it (a fresh reviewer's findings)."""
    from magicpig_jax.eval.bench_decode import throughput_spread

    ms = [7.0, 7.4, 7.6, 8.0]
    t = throughput_spread(ms, 3)
    assert t["median"] == pytest.approx(3000.0 / 7.5) and t["min"] == pytest.approx(3000.0 / 8.0)
    assert t["max"] == pytest.approx(3000.0 / 7.0) and t["values"] == pytest.approx([3000.0 / m for m in ms])
    text = tmp_path / "prose.json"
    text.write_text("some prose " * 100)
    with pytest.raises(SystemExit) as exc:
        bench_decode.main(["--lengths", "300", "--batch", "1", "--text", str(text), "--out", str(tmp_path / "prose")])
    assert exc.value.code == 2 and "--text" in capsys.readouterr().err
    assert text.read_text() == "some prose " * 100
