"""The pure layers import and run without the compiled extension (issue 16).

A subprocess hides ``magicpig_jax._host_ops`` (a ``sys.meta_path`` finder that raises
``ImportError`` for it, and no ``$MAGICPIG_HOST_OPS_LIB``), then imports the package, the
method layer (``lsh``, ``attention``), the loaders (``io``), the host package itself, and
runs a small computation from each with asserted values (no loader or method module may
import a ``magicpig_jax.host`` module); a second one runs every proof check of ``proofs/``
the same way. Both assert that the extension was never imported, and
that a host call fails with the ImportError that tells how to build it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests._xla import default_level
from tests.test_proofs import SCRIPTS, check_sites

ROOT = Path(__file__).resolve().parent.parent
PROOFS = ROOT / "proofs"
TIMEOUT_S = 300

_HIDE = textwrap.dedent('''
    import importlib.abc, sys

    class _NoExtension(importlib.abc.MetaPathFinder):
        """Raise ImportError for the compiled extension, as on a machine that never built it."""

        def find_spec(self, fullname, path=None, target=None):
            if fullname == "magicpig_jax._host_ops":
                raise ImportError("magicpig_jax._host_ops hidden by tests/test_pure_import.py")
            return None

    sys.meta_path.insert(0, _NoExtension())
''')

_END = textwrap.dedent('''
    import magicpig_jax.host as _host
    try:
        _host.has_avx2()
    except ImportError as e:
        assert "pip install" in str(e), e
    else:
        raise AssertionError("a host call ran with the extension hidden")
    assert "magicpig_jax._host_ops" not in sys.modules, "the extension was imported"
    print("PURE-OK")
''')

_LAYERS = textwrap.dedent('''
    import numpy as np
    import jax, jax.numpy as jnp

    import magicpig_jax
    from magicpig_jax import lsh
    from magicpig_jax.attention import MagicPIGConfig, build_lsh_index, dense_attention, magicpig_attention
    import magicpig_jax.eval, magicpig_jax.io, magicpig_jax.io.gguf_model, magicpig_jax.io.loader  # noqa
    from magicpig_jax.io import Tokenizer, embedded_model_path
    from magicpig_jax.io.gguf_blocks import QUANT_TYPES, packed_row_bytes
    kernels = sorted(m for m in sys.modules if m.startswith("magicpig_jax.host"))
    assert not kernels, f"the method layer or a loader imported a kernel module: {kernels}"
    import magicpig_jax.host  # the package imports; only its calls need the extension

    # lsh: bit j of table l is sign(x . P[:, l*K + j]); P = [I, -I] on D=2, K=2, L=2.
    proj = jnp.asarray([[1.0, 0.0, -1.0, 0.0], [0.0, 1.0, 0.0, -1.0]], jnp.float32)
    x = jnp.asarray([[1.0, 2.0], [-1.0, 3.0], [-2.0, -1.0]], jnp.float32)
    codes = np.asarray(lsh.simhash_codes(x, proj, 2, 2))
    assert codes.dtype == np.uint32 and codes.tolist() == [[3, 0], [2, 1], [0, 3]], codes.tolist()

    # attention: with every key static (sinks + local window cover N) MagicPIG is dense attention,
    # and dense attention is the float64 softmax.
    rng = np.random.default_rng(0)
    B, Hq, Hkv, N, D = 1, 4, 2, 12, 8
    q = rng.standard_normal((B, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, N, D)).astype(np.float32)
    lengths = jnp.asarray([N], jnp.int32)
    kk, vv = np.repeat(k, Hq // Hkv, axis=1), np.repeat(v, Hq // Hkv, axis=1)
    s = np.einsum("bhd,bhnd->bhn", q.astype(np.float64), kk) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("bhn,bhnd->bhd", p / p.sum(-1, keepdims=True), vv)
    out, lse = dense_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), lengths)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)
    cfg = MagicPIGConfig(K=2, L=4, num_sink=4, num_local=8)
    projections = lsh.simhash_projections(jax.random.key(0), head_dim=D, K=cfg.K, L=cfg.L)
    index = build_lsh_index(jnp.asarray(k), projections, cfg, lengths)
    out_m, lse_m, ns = magicpig_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), index, cfg, lengths)
    np.testing.assert_allclose(np.asarray(out_m), want, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse_m), np.asarray(lse), atol=1e-5)
    assert np.asarray(ns).tolist() == [[0, 0, 0, 0]]

    # io: GGUF block facts, and the embedded model's tokenizer from its GGUF metadata.
    assert QUANT_TYPES["Q4_1"] == (3, 20, 32) and QUANT_TYPES["Q6_K"] == (14, 210, 256)
    assert packed_row_bytes("Q4_1", 64) == 40 and packed_row_bytes("Q4_K", 512) == 288
    import gguf
    reader = gguf.GGUFReader(str(embedded_model_path()))
    meta = {name: f.contents() for name, f in reader.fields.items() if name.startswith("tokenizer.")}
    tok = Tokenizer.from_gguf_metadata(meta)
    ids = tok.encode("Hello, world!")
    assert len(ids) >= 3 and tok.decode(ids) == "Hello, world!", (ids, tok.decode(ids))
    assert tok.eos_token_ids and tok.chat_template
''')

_PROOFS = textwrap.dedent('''
    import contextlib, io, runpy
    from pathlib import Path

    proofs = Path(sys.argv[1])
    sys.path.insert(0, str(proofs))
    for script in sorted(p for p in proofs.glob("*.py") if not p.name.startswith("_")):
        sys.modules.pop("_check", None)  # its failure list and --perturb flag are per script
        sys.argv = [str(script)]
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            try:
                runpy.run_path(str(script), run_name="__main__")
                code = 0
            except SystemExit as e:
                code = e.code or 0
        passed = [ln for ln in buf.getvalue().splitlines() if "all checks passed (" in ln]
        assert code == 0 and passed, (script.name, code, buf.getvalue()[-2000:])
        print(f"proof ok: {script.stem}: {passed[-1]}")
''')


def _run_hidden(body: str, *args: str) -> subprocess.CompletedProcess:
    # XLA's default code generation (tests/_xla.py): the proofs run their programs long
    env = default_level({k: v for k, v in os.environ.items() if k != "MAGICPIG_HOST_OPS_LIB"})
    code = _HIDE + body + _END
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT_S)


def test_pure_layers_import_and_run_without_the_extension():
    r = _run_hidden(_LAYERS)
    assert r.returncode == 0 and "PURE-OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]


def test_proofs_run_without_the_extension():
    """Every proof check of proofs/ passes, each of its check sites evaluated (the count is
    tests/test_proofs.py's, from the script's source); test_proofs.py runs each perturbed."""
    r = _run_hidden(_PROOFS, str(PROOFS))
    assert r.returncode == 0 and "PURE-OK" in r.stdout, r.stdout[-3000:] + r.stderr[-5000:]
    assert len(SCRIPTS) >= 7
    for script in SCRIPTS:
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith(f"proof ok: {script.stem}: ")), "")
        assert f" evaluations of {check_sites(script)} checks)" in line, (script.stem, line)
