"""The attention methods of ``magicpig-jax eval``: what each is, and parsing ``--methods`` / ``--lengths``.

A method is dense attention, MagicPIG with ``K`` bits and ``L`` tables (arXiv 2410.16179,
Sections 3.2-4.3), or a baseline of Section 5 (TopK, Quest, oracle sampling of
Definition 3.1) whose budget is fixed or measured from a reference MagicPIG method. See
:mod:`magicpig_jax.eval.run` for how the comparison uses them.
"""

from __future__ import annotations

import dataclasses

__all__ = ["DEFAULT_METHODS", "Method", "parse_method", "parse_methods", "parse_lengths"]

DEFAULT_METHODS = "dense,magicpig:8x75,magicpig:10x150,magicpig:10x170,magicpig:11x300,topk,quest,oracle"


@dataclasses.dataclass(frozen=True)
class Method:
    """An attention method of the comparison.

    Attributes:
      label: its name in results and tables (``dense``, ``magicpig:10x150``, ``topk``, ``topk:160``).
      backend: the :data:`magicpig_jax.models.backends.BACKENDS` entry.
      K, L: MagicPIG's bits and tables (``magicpig`` only).
      budget: a fixed budget (int tokens or float fraction) for topk/quest/oracle, or None =
        measured from the reference MagicPIG method on each sample.
    """

    label: str
    backend: str
    K: int | None = None
    L: int | None = None
    budget: int | float | None = None

    @property
    def budgeted(self) -> bool:
        """True for the baselines that take a budget (topk, quest, oracle)."""
        return self.backend in ("topk", "quest", "oracle")


def parse_method(text: str) -> Method:
    """Parse one method: ``dense``, ``magicpig[:KxL]``, ``magicpig-ref[:KxL]``, ``topk|quest|oracle[:B]``.

    A budget ``B`` is an int number of tokens (>= 1) or a float fraction in ``(0, 1]``.

    Raises:
      ValueError: an unknown method, a malformed argument, or an invalid ``K``/``L``/budget.
    """
    from magicpig_jax.lsh import validate_k_l

    name, _, arg = text.strip().partition(":")
    name = name.strip().lower()
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
        return Method(f"{name}:{k}x{l_}", name, K=k, L=l_)
    if name in ("topk", "quest", "oracle"):
        if not arg:
            return Method(name, name)
        try:
            budget: int | float = int(arg) if arg.isdigit() else float(arg)
        except ValueError as err:
            raise ValueError(f"{name} takes a budget in tokens or a fraction, got {text!r}") from err
        if (isinstance(budget, int) and budget < 1) or (isinstance(budget, float) and not 0 < budget <= 1):
            raise ValueError(f"{name} budget must be >= 1 tokens or a fraction in (0, 1], got {arg!r}")
        return Method(f"{name}:{arg}", name, budget=budget)
    raise ValueError(f"unknown method {text!r}; methods: dense, magicpig[:KxL], magicpig-ref[:KxL], topk[:B], "
                     "quest[:B], oracle[:B]")


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
    ref = parse_method(budget_from)
    if not ref.backend.startswith("magicpig"):
        raise ValueError(f"--budget-from must be a magicpig:KxL method, got {budget_from!r}")
    if any(m.budgeted and m.budget is None for m in methods) and ref.label not in labels:
        methods.append(ref)
    rank = {"dense": 0, "magicpig": 1, "magicpig-ref": 1, "topk": 2, "quest": 3, "oracle": 4}
    return sorted(methods, key=lambda m: (rank[m.backend], m.label != ref.label))


def parse_lengths(text: str) -> list[int]:
    """``2K,4K,8K`` or ``2048,4096`` -> token counts (K = 1024).

    Raises:
      ValueError: a malformed or non-positive length.
    """
    out = []
    for x in (x.strip() for x in text.split(",")):
        if not x:
            continue
        try:
            n = int(float(x[:-1]) * 1024) if x[-1] in "kK" else int(x)
        except ValueError as err:
            raise ValueError(f"bad length {x!r} (use e.g. 2K,4K,8K or 2048)") from err
        if n < 64:
            raise ValueError(f"length must be >= 64 tokens, got {x!r}")
        out.append(n)
    if not out:
        raise ValueError("--lengths is empty")
    return out
