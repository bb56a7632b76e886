"""The attention methods of ``magicpig-jax eval``: what each is, and parsing ``--methods`` / ``--lengths``.

A method is dense attention, MagicPIG with ``K`` bits and ``L`` tables (arXiv 2410.16179,
Sections 3.2-4.3), the hybrid estimator (:mod:`magicpig_jax.attention.hybrid`), MagicPIG with
per-layer configurations from a ``magicpig-jax calibrate`` file, or a baseline of Section 5
(TopK, Quest, oracle sampling of Definition 3.1) whose budget is fixed or measured from a
reference MagicPIG method. See :mod:`magicpig_jax.eval.run` for how the comparison uses them.

Method names (``--methods``, comma-separated):

``dense``                   exact attention
``magicpig[:KxL]``          MagicPIG (the host op on the CPU backend); ``magicpig-ref[:KxL]``: pure JAX
``hybrid[:KxL[xM]]``        the hybrid estimator, heavy from ``M`` collisions (default 8; pure JAX)
``magicpig@FILE``           MagicPIG with the per-layer configurations of FILE (``calibrate``'s JSON)
``topk|quest|oracle[:B]``   the baselines; TopK and Quest run their host ops on the CPU backend;
                            ``topk-ref`` / ``quest-ref`` force the pure-JAX functions
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

__all__ = ["DEFAULT_METHODS", "Method", "parse_method", "parse_methods", "parse_lengths"]

DEFAULT_METHODS = "dense,magicpig:10x150,magicpig:11x300,hybrid:10x150x8,topk,quest,oracle"
DEFAULT_HEAVY = 8


@dataclasses.dataclass(frozen=True)
class Method:
    """An attention method of the comparison.

    Attributes:
      label: its name in results and tables (``dense``, ``magicpig:10x150``, ``topk``, ``topk:160``).
      backend: the :data:`magicpig_jax.models.backends.BACKENDS` entry.
      K, L: MagicPIG's bits and tables (``magicpig``, ``magicpig-ref``, ``hybrid``).
      budget: a fixed budget (int tokens or float fraction) for topk/quest/oracle, or None =
        measured from the reference MagicPIG method on each sample.
      heavy: the hybrid's heavy threshold (``hybrid`` only).
      config_file: a per-layer configurations file (``magicpig@FILE``).
      host: False forces the pure-JAX function of topk/quest (``topk-ref``); None: the backend's default.
    """

    label: str
    backend: str
    K: int | None = None
    L: int | None = None
    budget: int | float | None = None
    heavy: int | None = None
    config_file: str | None = None
    host: bool | None = None

    @property
    def budgeted(self) -> bool:
        """True for the baselines that take a budget (topk, quest, oracle)."""
        return self.backend in ("topk", "quest", "oracle")


def _check_host_index(where: str, K: int, L: int, hint: str = " (magicpig-ref, pure JAX, takes more)") -> None:
    """Refuse a (K, L) the host index cannot hold (method ``magicpig`` runs on it), before any model loads."""
    from magicpig_jax.host.index import HOST_MAX_K, HOST_MAX_L

    if K > HOST_MAX_K or L > HOST_MAX_L:
        raise ValueError(f"{where}: the host index takes K in [1, {HOST_MAX_K}] and L in [2, {HOST_MAX_L}], got "
                         f"K={K}, L={L}{hint}")


def parse_method(text: str) -> Method:
    """Parse one method (see the module docstring for the names).

    A budget ``B`` is an int number of tokens (>= 1) or a float fraction in ``(0, 1]``.

    Raises:
      ValueError: an unknown method, a malformed argument, or an invalid ``K``/``L``/budget/heavy.
      FileNotFoundError: ``magicpig@FILE`` names no file.
    """
    from magicpig_jax.lsh import validate_k_l

    text = text.strip()
    if text.lower().startswith("magicpig@"):
        path = Path(text[len("magicpig@"):])
        if not path.is_file():
            raise FileNotFoundError(f"method {text!r}: no layer-configs file {path}")
        from magicpig_jax.attention import LayerConfigs
        from magicpig_jax.eval.calibrate import recorded_identities
        from magicpig_jax.models.backends.spec import host_ops_by_default

        configs = LayerConfigs.load(path)  # the file's own errors name it
        recorded_identities(path)  # its model identities' types, before any model loads
        if host_ops_by_default():  # per-layer configs run on the host index
            for i, c in configs.layers:
                if c != "dense":
                    _check_host_index(f"method {text!r}: layer {i}", c.K, c.L, hint="")
        return Method(f"magicpig@{path.stem}", "magicpig", config_file=str(path))
    name, _, arg = text.partition(":")
    name, arg = name.strip().lower(), arg.strip()
    if name == "hybrid":
        parts = (arg or "10x150").lower().split("x")
        try:
            nums = [int(x) for x in parts]
        except ValueError as err:
            raise ValueError(f"hybrid takes KxL or KxLxM (e.g. hybrid:10x150x8), got {text!r}") from err
        if len(nums) not in (2, 3):
            raise ValueError(f"hybrid takes KxL or KxLxM (e.g. hybrid:10x150x8), got {text!r}")
        k, l_, m = (*nums, DEFAULT_HEAVY) if len(nums) == 2 else nums
        validate_k_l(k, l_)
        if not 3 <= m <= l_ + 1:
            raise ValueError(f"hybrid heavy threshold M must be in [3, L + 1], got {text!r}")
        return Method(f"hybrid:{k}x{l_}x{m}", "hybrid", K=k, L=l_, heavy=m)
    if name == "dense":
        if arg:
            raise ValueError(f"dense takes no argument, got {text!r}")
        return Method("dense", "dense")
    if name in ("magicpig", "magicpig-ref"):
        arg = arg or "10x150"
        try:
            k, l_ = (int(x) for x in arg.lower().split("x"))
        except ValueError as err:
            raise ValueError(f"{name} takes KxL (e.g. {name}:10x150), got {text!r}") from err
        validate_k_l(k, l_)
        if name == "magicpig":
            _check_host_index(f"method {text!r}", k, l_)
        return Method(f"{name}:{k}x{l_}", name, K=k, L=l_)
    if name in ("topk", "quest", "oracle", "topk-ref", "quest-ref"):
        backend = name.removesuffix("-ref")
        host = False if name.endswith("-ref") else None
        if not arg:
            return Method(name, backend, host=host)
        try:
            budget: int | float = int(arg) if arg.isascii() and arg.isdigit() else float(arg)
        except ValueError as err:
            raise ValueError(f"{name} takes a budget in tokens or a fraction, got {text!r}") from err
        from magicpig_jax.attention.baselines import MAX_BUDGET_TOKENS

        if (isinstance(budget, int) and not 1 <= budget <= MAX_BUDGET_TOKENS) or (
                isinstance(budget, float) and not 0 < budget <= 1):
            raise ValueError(f"{name} budget must be in [1, {MAX_BUDGET_TOKENS}] tokens or a fraction in (0, 1], "
                             f"got {arg!r}")
        # the label from the parsed budget: topk:016 and topk:16 (or :.5 and :0.5) are one method
        return Method(f"{name}:{budget!r}", backend, budget=budget, host=host)
    raise ValueError(f"unknown method {text!r}; methods: dense, magicpig[:KxL], magicpig-ref[:KxL], "
                     "hybrid[:KxL[xM]], magicpig@FILE, topk[:B], quest[:B], oracle[:B], topk-ref[:B], quest-ref[:B]")


def parse_methods(text: str, budget_from: str = "magicpig:10x150") -> list[Method]:
    """Parse ``--methods``; order: dense, MagicPIG (the budget reference first), the budgeted ones.

    The reference ``budget_from`` method is added when a budgeted method needs it.

    Raises:
      ValueError: an unknown or malformed method, or a duplicate.
    """
    methods = [parse_method(x) for x in text.split(",") if x.strip()]
    if not methods:
        raise ValueError("--methods is empty")
    labels = [m.label for m in methods]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise ValueError(f"duplicate methods: {dup}")
    try:
        ref = parse_method(budget_from)
    except ValueError as err:
        raise ValueError(f"--budget-from {budget_from!r}: {err}") from None
    if not ref.backend.startswith("magicpig") or ref.config_file is not None:
        raise ValueError(f"--budget-from must be a magicpig:KxL method, got {budget_from!r}")
    if any(m.budgeted and m.budget is None for m in methods) and ref.label not in labels:
        methods.append(ref)
    rank = {"dense": 0, "magicpig": 1, "magicpig-ref": 1, "hybrid": 1, "topk": 2, "quest": 3, "oracle": 4}
    return sorted(methods, key=lambda m: (rank[m.backend], m.label != ref.label))


def parse_lengths(text: str) -> list[int]:
    """``2K,4K,8K`` or ``2048,4096`` -> token counts (K = 1024).

    Raises:
      ValueError: a malformed or non-positive length, or one given twice (``2K,2048``).
    """
    out = []
    for x in (x.strip() for x in text.split(",")):
        if not x:
            continue
        try:
            n = int(float(x[:-1]) * 1024) if x[-1] in "kK" else int(x)
        except (ValueError, OverflowError) as err:  # "nanK"; "infK" overflows int()
            raise ValueError(f"bad length {x!r} (use e.g. 2K,4K,8K or 2048)") from err
        if n < 64:
            raise ValueError(f"length must be >= 64 tokens, got {x!r}")
        if n in out:
            raise ValueError(f"--lengths gives {n} tokens twice (got {text!r})")
        out.append(n)
    if not out:
        raise ValueError("--lengths is empty")
    return out
