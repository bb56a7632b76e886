"""The example notebooks execute headless (nbclient + ipykernel); their cells assert the numbers they claim.

One test per notebook, each with a time limit. The notebooks are committed without
outputs, with an "Open in Colab" badge and a first code cell that installs the package
only where it is not importable (so here it is skipped).
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from tests._xla import default_level

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = sorted(EXAMPLES.glob("*.ipynb"))
EXPECTED = {
    "01_estimator_in_ten_minutes.ipynb",
    "02_magicpig_in_your_flax_model.ipynb",
    "03_long_context_smollm2.ipynb",
    "04_sampling_beats_topk_on_aggregation.ipynb",
}
# Seconds per notebook; measured 20-60 s on the 2-core CI machine.
TIMEOUT = 240
# These notebooks run at the suite's XLA optimization level 0 (tests/_xla.py): their programs are small,
# so compiling them takes longer than running them. The others run long programs (a 1,200-token
# prefill of SmolLM2, a training loop) at XLA's default level, which was not slower for them.
AT_TEST_LEVEL = {"01_estimator_in_ten_minutes.ipynb", "02_magicpig_in_your_flax_model.ipynb"}


def _read(path: Path):
    return nbformat.read(path, as_version=4)


def test_notebooks_present():
    assert EXPECTED <= {p.name for p in NOTEBOOKS}
    assert AT_TEST_LEVEL <= EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_structure(path):
    nb = _read(path)
    nbformat.validate(nb)
    first = nb.cells[0]
    assert first.cell_type == "markdown"
    badge = f"https://colab.research.google.com/github/magicpig-jax/magicpig_jax/blob/main/examples/{path.name}"
    assert "colab-badge.svg" in first.source and badge in first.source
    install = next(c for c in nb.cells if c.cell_type == "code")
    assert 'find_spec("magicpig_jax") is None' in install.source
    assert re.search(r'%pip install .*"magicpig-jax @ git\+https://github.com/magicpig-jax/magicpig_jax"',
                     install.source)
    assert any("parameters" in c.metadata.get("tags", []) for c in nb.cells), "no parameter cell"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None, (
                f"{path.name} is committed with outputs: clear them")
    assert sum("assert " in c.source for c in nb.cells if c.cell_type == "code") >= 2


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    nb = _read(path)
    monkeypatch.setenv("MPLBACKEND", "Agg")  # the kernel inherits it: figures are drawn, not rendered to PNG
    env = dict(os.environ) if path.name in AT_TEST_LEVEL else default_level(dict(os.environ))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    if "XLA_FLAGS" in env:  # the kernel inherits it
        monkeypatch.setenv("XLA_FLAGS", env["XLA_FLAGS"])
    client = nbclient.NotebookClient(nb, timeout=TIMEOUT, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    print(f"{path.name}: {seconds:.1f} s")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    assert seconds < TIMEOUT
