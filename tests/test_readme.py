"""The README's code blocks run, with small sizes, and say what the README says they say.

Every fenced ``python`` block runs, in order, in one fresh interpreter (later blocks use the
arrays of earlier ones, as a reader running them in one session would). Every command line
of every ``bash``/``sh``/``console`` block runs as a shell command in one scratch directory,
with the package's own ``magicpig-jax`` first on ``PATH``. Long runs are shrunk by
:data:`BASH_SUBSTITUTIONS` / :data:`PYTHON_SUBSTITUTIONS` (exact substrings; a substitution
that no longer matches the README fails the test, so the table cannot go stale). Commands
that are not run are listed in :data:`EXCLUDED` with the reason, and each must still be in
the README. Each block and command must exit 0 and print (or write) what its expectation
below checks; a new block without an expectation fails until one is added.

Also checked: the README's length (at most 300 lines), the relative links of the README and
``docs/``, and that the Layout section names every package and public module.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._xla import with_test_flag

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BIN = Path(sys.executable).parent  # the venv's bin: magicpig-jax is installed beside python
TIMEOUT = 420  # seconds per command or for all Python blocks; each CLI start loads the 135M model

# Command lines not run, with the reason (matched as substrings of the command).
EXCLUDED = {
    "make demo": "what `make demo` runs (a fresh venv, installs, the 5.9K-token demo) is CI's job, not a unit test's",
    "make test": "this is the suite itself (`.ci/run` runs it)",
    '.venv/bin/pip install -e ".[peer]"': "installs llama-cpp-python, an optional extra that compiles for ~10 min",
    "--peer llama.cpp": "needs llama-cpp-python (optional extra `.[peer]`, not installed for the suite)",
}

TINY_DOCUMENT = "The test suite runs with the command `make test`. The demo runs with `make demo`.\n"

# README text -> what the test runs instead (same command, smaller sizes).
BASH_SUBSTITUTIONS = {
    "--max-new-tokens 48": "--max-new-tokens 4",
    "--document README.md": "--document tiny.txt",
    "--n 8192 32768 131072": "--n 2048 --shapes smollm2-135m --reps 3",
    "--lengths 1024 4096 8192 --steps 64": "--lengths 512 --steps 4 --warmup 0",
    "study attention --out runs/study":
        "study attention --n 512 --heads 1 --profiles zipf --repeats 1 --fractions 0.05 --lsh 8x60 --no-plot"
        " --out runs/study",
    "--tasks niah_single,fwe --lengths 2K --samples 1":
        "--tasks niah_single --lengths 1K --samples 1 --setups A --likelihood-samples 1 --likelihood-tokens 8"
        " --no-plot --no-progress",
}
PYTHON_SUBSTITUTIONS = {
    "max_new_tokens=64": "max_new_tokens=8",
    "B, Hq, Hkv, N, D = 2, 8, 2, 8192, 64": "B, Hq, Hkv, N, D = 2, 8, 2, 2048, 64",
}


def _json(path: Path) -> dict | list:
    assert path.is_file(), f"{path} was not written"
    return json.loads(path.read_text())


def _check_generate_two(out: str, cwd: Path) -> None:
    assert "=== answer with magicpig attention (" in out
    assert "=== answer with dense attention (" in out
    assert "answers identical across backends:" in out


def _check_generate_json(out: str, cwd: Path) -> None:
    assert "=== answer with magicpig attention (" in out
    data = _json(cwd / "runs" / "haiku.json")
    assert set(data["results"]) == {"magicpig"}
    assert data["results"]["magicpig"]["token_ids"], "no token generated"


def _check_convert(out: str, cwd: Path) -> None:
    assert re.search(r"loaded back before it was kept; use it with --model \S*runs/smollm2-ckpt\)", out), out
    assert (cwd / "runs" / "smollm2-ckpt").is_dir()


def _check_generate_checkpoint(out: str, cwd: Path) -> None:
    assert "smollm2-ckpt" in out, "the run does not name the checkpoint as its model"
    assert "=== answer with dense attention (" in out


def _check_bench_attention(out: str, cwd: Path) -> None:
    # what the JSON's figures imply for the shape and N the command names
    rows = _json(cwd / "runs" / "bench_attention.json")["results"]
    assert [(r["shape"], r["N"]) for r in rows] == [("smollm2-135m", 2048)]
    (r,) = rows
    assert r["host_attention_ms"] > 0
    assert (r["K"], r["L"], r["Hq"], r["Hkv"], r["D"]) == (10, 150, 9, 3, 64)
    # bf16 K and V rows: 2 * D * 2 bytes; the index: 2L (ids) + 2L(2^K + 1)/CH (offsets) + 2L*OPEN/C per token
    # with one chunk CH = C = 2048 and the open chunk of 512 (docs/host_op.md), plus the 12 bytes of bounds
    assert r["kv_bytes_per_token_per_kv_head"] == 256
    L, K, C = 150, 10, 2048
    per_token = 2 * L + 2 * L * (2**K + 1) / C + 2 * L * 512 / C + 12 / (C * 3)
    assert r["index_bytes_per_token_per_kv_head"] == pytest.approx(per_token, rel=1e-9)
    assert r["index_to_kv_ratio"] == pytest.approx(r["index_bytes_per_token_per_kv_head"] / 256)
    # the huge-page scope is the same bytes (it had left the open chunk out: 2.345 against 2.931 here)
    assert r["index_bytes"] == pytest.approx(r["index_to_kv_ratio"] * r["kv_bytes"])
    hashed = 2048 - 4 - 64
    assert r["sampled_fraction"] == pytest.approx(r["mean_sampled_per_head"] / hashed)
    assert 0 < r["sampled_fraction"] < 0.2
    assert r["speedup_vs_dense"] == pytest.approx(r["dense_ms"] / r["host_attention_ms"])
    # the paired fraction: each cold call against the copy timed just before it, so it lies between
    # the ratios of the extremes of the op's times and the copies' bandwidths
    op, cp = r["host_op_only_spread_ms"], r["copy_GBps_paired"]
    lo = r["bytes_touched"] / (1e-3 * op["max"]) / (1e9 * cp["max"])
    hi = r["bytes_touched"] / (1e-3 * op["min"]) / (1e9 * cp["min"])
    assert 0 < cp["min"] <= cp["median"] <= cp["max"]
    assert lo * (1 - 1e-9) <= r["fraction_of_copy_bw_paired"] <= hi * (1 + 1e-9)
    assert (cwd / "runs" / "bench_attention.png").is_file()


def _check_bench_decode(out: str, cwd: Path) -> None:
    rows = _json(cwd / "runs" / "bench_decode.json")["results"]
    assert {r["method"] for r in rows} == {"dense", "magicpig"}
    assert all(r["prompt_tokens"] == 512 and r["ms_per_token"] > 0 for r in rows)


def _check_study(out: str, cwd: Path) -> None:
    methods = {r["method"] for r in _json(cwd / "runs" / "study" / "study.json")["summary"]}
    assert {"topk", "quest", "oracle", "magicpig"} <= methods


def _check_eval(out: str, cwd: Path) -> None:
    summary = _json(cwd / "runs" / "eval" / "summary.json")
    assert set(summary) == {"setups", "equal_ms", "1024"} and summary["setups"] == ["A"]
    assert {"dense", "magicpig:10x150", "topk"} <= set(summary["1024"])
    assert "### Context 1024 tokens" in out and "| magicpig:10x150 |" in out
    assert (cwd / "runs" / "eval" / "summary.md").is_file()
    # the records: SmolLM2 finds one needle in 1K tokens of license text; each method's sampled
    # fraction, per-layer fractions (the default dense layers 0 and 15 excluded), KL, PPL, top-1
    recs = [json.loads(x) for x in (cwd / "runs" / "eval" / "results.jsonl").read_text().splitlines()]
    assert len(recs) == 6
    task = {r["method"]: r for r in recs if r["kind"] == "task"}
    lik = {r["method"]: r for r in recs if r["kind"] == "likelihood"}
    assert task["dense"]["score"] == 1.0 and task["dense"]["outputs"][0] in task["dense"]["prediction"]
    for r in recs:
        assert 800 <= r["prompt_tokens"] <= 1024
        assert r["sampled_fraction"] == 1.0 if r["method"] == "dense" else 0 < r["sampled_fraction"] < 0.2
    assert set(map(int, task["magicpig:10x150"]["sampled_fraction_per_layer"])) == set(range(30)) - {0, 15}
    assert lik["dense"]["kl"] == 0.0 and lik["dense"]["top1"] == 1.0
    assert 0 < lik["magicpig:10x150"]["kl"] < 1 and 0 < lik["topk"]["kl"] < 1
    assert all(1 < r["ppl"] < 1000 for r in lik.values())


# A substring identifying each README command -> its check of (stdout + stderr, scratch dir).
BASH_EXPECTATIONS = {
    "generate --document": _check_generate_two,
    "--json runs/haiku.json": _check_generate_json,
    "convert embedded": _check_convert,
    "--model runs/smollm2-ckpt": _check_generate_checkpoint,
    "bench attention": _check_bench_attention,
    "bench decode": _check_bench_decode,
    "study attention": _check_study,
    "magicpig-jax eval": _check_eval,
}


def _expect(section: str, text: str) -> None:
    assert text in section, f"expected {text!r} in the block's output:\n{section}"


def _generated(section: str) -> None:
    lines = [line for line in section.splitlines() if line.strip()]
    assert len(lines) >= 2, f"expected the text and the stats line:\n{section}"
    assert re.search(r"^magicpig\b", section, re.M), f"expected the stats line to start with 'magicpig':\n{section}"


def _relative_error_small(section: str) -> None:
    m = re.search(r"relative error vs dense: ([0-9.eE+-]+)", section)
    assert m, section
    assert float(m.group(1)) < 0.2, section
    assert re.search(r"sampled fraction: \[[0-9. e+-]+\]", section), section


# A substring identifying each README Python block -> its check of that block's output.
def _batch_and_stream(section: str) -> None:
    """Two rows with their stop reasons, then a streamed answer on the same line."""
    first, _, streamed = section.partition("\n")
    rows = ast.literal_eval(first)
    reasons = ("eos", "stop", "length", "context")
    assert len(rows) == 2 and all(isinstance(t, str) and r in reasons for t, r in rows), rows
    assert streamed.strip(), f"nothing was streamed: {section!r}"


PYTHON_EXPECTATIONS = {
    "magicpig_jax.load_model(": _generated,
    "build_lsh_index(k, proj": _relative_error_small,
    "host_magicpig_attention(q, k, v, hidx": lambda s: _expect(s, "same keys sampled as the reference: True"),
    "offload.prepare_offload(": lambda s: _expect(s, "offload equals the host op: True"),
    "dist.make_mesh(": lambda s: _expect(s, "sharded equals one device: True"),
    "stream=True": _batch_and_stream,
}


# --- reading the README ----------------------------------------------------------------------

FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)


def _blocks(text: str) -> list[tuple[str, str]]:
    return [(m.group(1).lower(), m.group(2)) for m in FENCE.finditer(text)]


def _commands(block: str) -> list[str]:
    """The command lines of a shell block: continuations joined, comments and blanks dropped."""
    out, pending = [], ""
    for line in block.splitlines():
        line = pending + line
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        if line.startswith("$ "):
            line = line[2:]
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    return out


README_TEXT = README.read_text(encoding="utf-8")
BLOCKS = _blocks(README_TEXT)
SHELL = [c for lang, b in BLOCKS if lang in ("bash", "sh", "console", "shell") for c in _commands(b)]
PYTHON = [b for lang, b in BLOCKS if lang in ("python", "py")]
RUN = [c for c in SHELL if not any(key in c for key in EXCLUDED)]


def _substitute(text: str, table: dict[str, str]) -> str:
    for old, new in table.items():
        text = text.replace(old, new)
    return text


def _one(table: dict, text: str, what: str):
    keys = [k for k in table if k in text]
    assert len(keys) == 1, f"{what} {text[:80]!r} matches {len(keys)} expectations ({keys}); give it exactly one"
    return table[keys[0]]


# --- tests --------------------------------------------------------------------------------------

def test_readme_is_short():
    n = len(README_TEXT.splitlines())
    assert n <= 300, f"README.md has {n} lines; keep it to 300 (details go to docs/)"


def test_tables_match_the_readme():
    """Every exclusion and substitution still matches the README; every block has an expectation."""
    for key in EXCLUDED:
        assert any(key in c for c in SHELL), f"EXCLUDED {key!r} no longer matches a README command"
    for key in BASH_SUBSTITUTIONS:
        assert any(key in c for c in RUN), f"BASH_SUBSTITUTIONS {key!r} no longer matches a README command"
    for key in PYTHON_SUBSTITUTIONS:
        assert any(key in b for b in PYTHON), f"PYTHON_SUBSTITUTIONS {key!r} no longer matches a README block"
    assert RUN and PYTHON
    for c in RUN:
        _one(BASH_EXPECTATIONS, c, "command")
        assert c.startswith("magicpig-jax "), f"a README command the test does not know how to run: {c!r}"
    for b in PYTHON:
        _one(PYTHON_EXPECTATIONS, b, "Python block")


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("readme")
    (d / "tiny.txt").write_text(TINY_DOCUMENT)
    (d / "runs").mkdir()
    return d


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["TQDM_DISABLE"] = "1"
    env.update(extra)
    return env


def _id(i: int, command: str) -> str:
    words = re.findall(r"[\w.-]+", command.removeprefix("magicpig-jax "))
    return f"{i}-" + "-".join(words[:3])


@pytest.mark.parametrize("command", RUN, ids=[_id(i, c) for i, c in enumerate(RUN)])
def test_readme_command(command, scratch):
    assert (BIN / "magicpig-jax").exists(), f"{BIN / 'magicpig-jax'} is missing: install the package (make install)"
    run = _substitute(command, BASH_SUBSTITUTIONS)
    proc = subprocess.run(["bash", "-c", f"set -euo pipefail; {run}"], cwd=scratch, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"`{run}` exited {proc.returncode}:\n{out[-4000:]}"
    assert "Traceback" not in out, f"`{run}` printed a traceback:\n{out[-4000:]}"
    _one(BASH_EXPECTATIONS, command, "command")(out, scratch)


def test_readme_python(scratch):
    """All Python blocks in one interpreter, in order; 4 CPU devices for the mesh block (as the README says)."""
    parts = []
    for i, block in enumerate(PYTHON):
        parts.append(f"print('<<<block {i}>>>', flush=True)\n")
        parts.append(_substitute(block, PYTHON_SUBSTITUTIONS))
    script = scratch / "readme_blocks.py"
    script.write_text("\n".join(parts))
    env = _env(XLA_FLAGS=with_test_flag("--xla_force_host_platform_device_count=4"))
    proc = subprocess.run([sys.executable, str(script)], cwd=scratch, capture_output=True, text=True,
                          timeout=TIMEOUT, env=env)
    reached = re.findall(r"<<<block (\d+)>>>", proc.stdout)
    assert proc.returncode == 0, (f"README Python block {reached[-1] if reached else 0} failed:\n"
                                  f"{(proc.stdout + proc.stderr)[-4000:]}")
    sections = re.split(r"<<<block \d+>>>\n", proc.stdout)[1:]
    assert len(sections) == len(PYTHON)
    for block, section in zip(PYTHON, sections, strict=True):
        _one(PYTHON_EXPECTATIONS, block, "Python block")(section)


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md", "docs/host_op.md", "docs/benchmarks.md",
                                 "docs/evaluation.md", "examples/results/README.md"])
def test_relative_links_resolve(doc):
    path = ROOT / doc
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, fragment = target.partition("#")
        linked = path.parent / file if file else path
        assert linked.exists(), f"{doc} links to {target}, which does not exist"
        if fragment and linked.suffix == ".md":
            assert fragment in _heading_anchors(linked), f"{doc} links to {target}: no such heading in {file or doc}"


def _heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings: lower case, characters other than
    word characters, hyphens and spaces dropped, spaces as hyphens, ``-1``, ``-2`` ... on repeats."""
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6}[ \t]+(.*?)[ \t#]*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _layout_section() -> str:
    m = re.search(r"^## Layout\n(.*?)(?=^## )", README_TEXT, re.M | re.S)
    assert m, "README.md has no '## Layout' section"
    return m.group(1)


# Modules kept only so old imports keep working; the Layout names where the code now lives.
ALIASES: dict[str, str] = {}


def test_layout_names_every_room():
    layout = _layout_section()
    named = set(re.findall(r"`([\w./-]+)`", layout))
    for name in named:
        if "/" in name or name.endswith(".py"):
            assert (ROOT / name).exists() or (ROOT / "magicpig_jax" / name).exists(), \
                f"the Layout names {name}, which does not exist"
    pkg = ROOT / "magicpig_jax"
    rooms = [f"magicpig_jax/{p.name}/" for p in sorted(pkg.iterdir()) if (p / "__init__.py").is_file()]
    rooms += [f"magicpig_jax/{p.name}" for p in sorted(pkg.glob("*.py"))
              if not p.name.startswith("_") and p.stem not in ALIASES]
    rooms += ["host_ops/", "proofs/", "examples/", "docs/", "tests/"]
    for room in rooms:
        assert room in layout or room.rstrip("/") in layout or room.removeprefix("magicpig_jax/") in layout, \
            f"the README's Layout does not name {room}"
