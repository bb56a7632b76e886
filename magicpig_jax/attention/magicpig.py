"""MagicPIG: LSH sampling with self-normalized importance weights (pure-JAX reference).

Source: arXiv 2410.16179, Sections 3.2-4.3: keys are centered by their mean,
hashed with SimHash (K bits, L tables); a key is sampled when its code equals the
query's in at least 2 tables, with probability ``u`` (Eq. (9)); the sampled keys
enter the softmax with logit ``q·k/sqrt(D) - log u`` (self-normalized importance
sampling, Eq. (4)), next to the static set (sinks, local window, generated
tokens) kept exactly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, UInt32

from magicpig_jax import lsh
from magicpig_jax.attention._common import (
    check_lengths,
    check_qkv,
    check_softcap,
    grouped_logits,
    masked_softmax_attention,
)
from magicpig_jax.attention.config import MagicPIGConfig

__all__ = ["LSHIndex", "build_lsh_index", "hashed_mean", "magicpig_attention", "LOG_U_FLOOR",
           "mean_or_nan_for_projections"]

# Convention for the importance weight: the exact log u (no additive offset as
# in the reference's log(u + 1e-4)), floored at log(1e-30) so that a key whose
# true u underflows (p = 0) still gets a finite logit.
LOG_U_FLOOR = -69.07755278982137


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LSHIndex:
    """The hash index of one layer's keys, built after prefill (a pytree).

    Attributes:
      codes: uint32 ``[B, Hkv, N, L]``, SimHash codes of the centered keys; only
        positions in ``[start, end)`` are meaningful.
      mean: float32 ``[B, Hkv, D]``, the mean of the keys in ``[start, end)``
        (zero when that range is empty, or for an index built with ``center=False``),
        subtracted before hashing.
      start: int32 ``[B]``, first hashed position (= min(num_sink, length)).
      end: int32 ``[B]``, one past the last hashed position
        (= max(length - num_local, start)).
      projections: float32 ``[D, K*L]``, the SimHash hyperplanes; the query is
        hashed with the same ones.
      num_sink, num_local: static (pytree metadata), the static set the index was built
        with (:func:`build_lsh_index` records them); the attention functions refuse a
        config that differs. None: not recorded (an index assembled by hand).

    Source: arXiv 2410.16179, Section 4.3 (tables built once after prefill).
    """

    codes: UInt32[Array, "B Hkv N L"]
    mean: Float[Array, "B Hkv D"]
    start: Int[Array, " B"]
    end: Int[Array, " B"]
    projections: Float[Array, "D KL"]
    num_sink: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    num_local: int | None = dataclasses.field(default=None, metadata=dict(static=True))


def build_lsh_index(
    k: Float[Array, "B Hkv N D"],
    projections: Float[Array, "D KL"],
    config: MagicPIGConfig,
    lengths: Int[Array, " B"] | None = None,
    *,
    center: bool = True,
) -> LSHIndex:
    """Center and hash the keys at positions ``[num_sink, lengths - num_local)``.

    The mean is taken over exactly the hashed keys of each (row, KV head)
    (arXiv 2410.16179, Section 4.2, "centering"); the codes are
    :func:`magicpig_jax.lsh.simhash_codes` of ``k - mean``.

    Args:
      k: float ``[B, Hkv, N, D]`` keys (any float dtype).
      projections: float32 ``[D, K*L]`` from :func:`magicpig_jax.lsh.simhash_projections`.
      config: the :class:`MagicPIGConfig` (K, L, num_sink, num_local).
      lengths: int ``[B]``, valid keys per row (default N; values outside ``[0, N]`` are
        clipped into it, as under ``jit`` they cannot be refused).
      center: static; ``False`` builds the uncentered ablation (``mean = 0``: raw
        keys are hashed and their raw angles give ``u``), for studies only.

    Returns:
      An :class:`LSHIndex`.

    Raises:
      ValueError: k is not 4-D, projections is not ``[D, K*L]`` or holds a NaN, infinity or zero column (concrete;
        traced, the index's mean becomes NaN: :func:`mean_or_nan_for_projections`), or lengths is not ``[B]``.
      TypeError: k or projections not an array, k not a floating dtype, lengths not integers, config
        not a MagicPIGConfig.
    """
    for name, a in (("k", k), ("projections", projections)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{name} must be an array (jax or NumPy), got {type(a).__name__}")
    if k.ndim != 4:
        raise ValueError(f"k must be [B, Hkv, N, D], got shape {tuple(k.shape)}")
    if not jnp.issubdtype(k.dtype, jnp.floating):
        raise TypeError(f"k must be a floating dtype, got {k.dtype}")
    if not isinstance(config, MagicPIGConfig):
        raise TypeError(f"config must be a MagicPIGConfig, got {type(config).__name__}")
    if not isinstance(center, bool):
        raise TypeError(f"center must be a bool, got {type(center).__name__} {center!r}")
    B, _, N, D = k.shape
    if projections.shape != (D, config.K * config.L):
        raise ValueError(
            f"projections must be [D, K*L] = [{D}, {config.K * config.L}] for K={config.K}, "
            f"L={config.L}, got {tuple(projections.shape)}"
        )
    lengths = check_lengths(lengths, B, N)
    start, end, mean = hashed_mean(k, config, lengths)
    kf = k.astype(jnp.float32)
    if not center:
        mean = jnp.zeros_like(mean)
    mean = mean_or_nan_for_projections(mean, projections)
    # One materialized mean for the codes and for the index: inside a larger jitted program XLA
    # could otherwise recompute it within the hashing fusion (contracting the subtraction with the
    # division), and a centered key at rounding level would be hashed from another vector than the
    # one u is later computed from (a biased estimate).
    mean = jax.lax.optimization_barrier(mean)
    codes = lsh.simhash_codes(kf - mean[:, :, None, :], projections, config.K, config.L)
    return LSHIndex(codes=codes, mean=mean, start=start, end=end, projections=projections,
                    num_sink=config.num_sink, num_local=config.num_local)


def hashed_mean(
    k: Float[Array, "B Hkv N D"], config: MagicPIGConfig, lengths: Int[Array, " B"]
) -> tuple[Int[Array, " B"], Int[Array, " B"], Float[Array, "B Hkv D"]]:
    """``(start, end, mean)``: the hashed range and the float32 mean of its keys per row and KV head.

    The centering of :func:`build_lsh_index` (arXiv 2410.16179, Section 4.2), shared with the host
    build: ``[start, end) = config.hashed_range(lengths)``; the keys in it summed in float32 and
    divided by ``max(end - start, 1)``; an empty range gives 0.

    Args:
      k: float ``[B, Hkv, N, D]`` keys (any float dtype).
      config: the :class:`MagicPIGConfig`.
      lengths: int ``[B]``, valid keys per row.

    Returns:
      ``(start, end)`` int32 ``[B]`` and the mean float32 ``[B, Hkv, D]``.

    Raises nothing itself: ``lengths`` is expected checked (:func:`build_lsh_index` does).
    """
    N = k.shape[2]
    start, end = config.hashed_range(lengths)
    pos = jnp.arange(N, dtype=jnp.int32)
    in_range = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])
    count = jnp.maximum(end - start, 1).astype(jnp.float32)
    mean = jnp.sum(jnp.where(in_range[:, None, :, None], k.astype(jnp.float32), 0.0), axis=2)
    return start, end, mean / count[:, None, None]


def sampled_mask_and_log_u(
    q: jax.Array, k: jax.Array, index: LSHIndex, config: MagicPIGConfig, lengths: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Which keys the LSH lookup samples, and their ``log u``.

    Returns ``sampled`` bool ``[B, Hkv, G, N]``, ``static`` bool ``[B, 1, 1, N]``
    (valid keys outside the hashed range) and ``log_u`` float32 ``[B, Hkv, G, N]``.
    """
    B, Hq, D = q.shape
    Hkv, N = k.shape[1], k.shape[2]
    G = Hq // Hkv
    pos = jnp.arange(N, dtype=jnp.int32)
    valid = pos[None, :] < lengths[:, None]
    in_range = (pos[None, :] >= index.start[:, None]) & (pos[None, :] < index.end[:, None]) & valid
    q_codes = lsh.simhash_codes(q, index.projections, config.K, config.L).reshape(B, Hkv, G, 1, config.L)
    hits = jnp.sum(q_codes == index.codes[:, :, None, :, :], axis=-1, dtype=jnp.int32)
    sampled = (hits >= 2) & in_range[:, None, None, :]
    static = (valid & ~in_range)[:, None, None, :]
    kc = lsh.exponent_scaled(k.astype(jnp.float32) - index.mean[:, :, None, :])
    qg = lsh.exponent_scaled(q.reshape(B, Hkv, G, D))
    dots = jnp.einsum("bhgd,bhnd->bhgn", qg, kc, precision=jax.lax.Precision.HIGHEST)
    cos = lsh.cosine_from_dots(dots, qg[..., None, :], kc[:, :, None, :, :])
    p = lsh.collision_probability_from_cosine(cos)
    log_u = jnp.maximum(lsh.log_sampling_probability(p, config.K, config.L), LOG_U_FLOOR)
    return sampled, static, log_u


def magicpig_attention(
    q: Float[Array, "B Hq D"],
    k: Float[Array, "B Hkv N D"],
    v: Float[Array, "B Hkv N D"],
    index: LSHIndex,
    config: MagicPIGConfig,
    lengths: Int[Array, " B"] | None = None,
    *,
    softcap: float | None = None,
) -> tuple[Float[Array, "B Hq D"], Float[Array, "B Hq"], Int[Array, "B Hq"]]:
    """One decode step of MagicPIG attention (pure-JAX reference).

    Keys in the index's hashed range ``[start, end)`` are sampled when their code
    equals the query's in at least 2 of the L tables and enter the softmax with
    logit ``q·k/sqrt(D) - log u``; ``u`` is :func:`magicpig_jax.lsh.sampling_probability`
    of the angle between the query and the centered key. Every other valid key
    (sinks, local window, keys appended after the index was built) is exact.
    Because the centering shift ``q·mean`` is the same for every logit of a query
    it cancels in the softmax: with every key static the result equals
    :func:`dense_attention`. ``log u`` is exact, floored at ``LOG_U_FLOOR`` = log(1e-30).

    Args:
      q: float ``[B, Hq, D]``.
      k, v: float ``[B, Hkv, N, D]``.
      index: the :class:`LSHIndex` built from these keys (same B, Hkv, N).
      config: the :class:`MagicPIGConfig` the index was built with.
      lengths: int ``[B]``, valid keys per row (default N; clipped into ``[0, N]``); may
        exceed the length the index was built at (appended keys are static). A length below
        ``index.end`` (a cache rolled back after the build) empties the static tail
        ``[index.end, lengths)``: the last ``num_local`` keys below the length are sampled, not
        kept exact, and the mean still counts the keys past the length. Rebuild the index
        after a rollback for the build's accuracy.
      softcap: None, or c in [0.001, 1e6]: every logit ``s = q·k/sqrt(D)`` becomes ``c * tanh(s / c)``
        before ``log u`` is subtracted (Gemma 2's ``attn_logit_softcapping``: the capped
        score is the attention's weight; the sampling, by angle, is unchanged).

    Returns:
      ``(out, lse, num_sampled)``: out float32 ``[B, Hq, D]``; lse float32
      ``[B, Hq]`` on the scale of the uncentered logits (so it merges with any
      other part via :func:`merge_attention`); num_sampled int32 ``[B, Hq]``. A head
      whose index mean is not finite (a NaN or infinite key in the hashed range), or whose
      query is not finite, gets out and lse NaN: the codes carry no information.

    Raises:
      ValueError / TypeError: bad shapes or dtypes, or an index that does not fit (its
        shapes, or a ``num_sink`` / ``num_local`` other than ``config``'s: :func:`check_index_fits`),
        or a softcap out of [0.001, 1e6].

    Source: arXiv 2410.16179, Eq. (4) and (9), Sections 4.2-4.3.
    """
    softcap = check_softcap(softcap)
    B, Hq, Hkv, N, D = check_qkv(q, k, v)
    if not isinstance(config, MagicPIGConfig):
        raise TypeError(f"config must be a MagicPIGConfig, got {type(config).__name__}")
    check_index_fits(index, config, B, Hkv, N, D)
    lengths = check_lengths(lengths, B, N)
    sampled, static, log_u = sampled_mask_and_log_u(q, k, index, config, lengths)
    logits = grouped_logits(q, k, softcap)
    logits = jnp.where(sampled, logits - log_u, logits)
    out, lse = masked_softmax_attention(logits, sampled | static, v)
    num_sampled = jnp.sum(sampled, axis=-1, dtype=jnp.int32).reshape(B, Hq)
    out, lse = nan_if_not_finite(out, lse, index, q)
    return out, lse, num_sampled


def check_index_fits(index: LSHIndex, config: MagicPIGConfig, B: int, Hkv: int, N: int, D: int) -> None:
    """Raise unless ``index`` is an :class:`LSHIndex` of ``[B, Hkv, N]`` keys of dimension D built for ``config``.

    Raises:
      TypeError: ``index`` is not an :class:`LSHIndex`, a field of it is not an array, or its
        projections are not float.
      ValueError: ``index.codes`` is not ``[B, Hkv, N, L]``, ``index.projections`` not ``[D, K*L]``,
        ``index.mean`` not ``[B, Hkv, D]``, ``index.start``/``index.end`` not ``[B]``, or the
        index was built with another ``num_sink`` / ``num_local`` than ``config``'s (its static
        set is ``[0, index.start)`` and ``[index.end, lengths)``, so a config that differs would be
        ignored).
    """
    if not isinstance(index, LSHIndex):
        raise TypeError(f"index must be an LSHIndex (build_lsh_index), got {type(index).__name__}")
    for name in ("codes", "projections", "mean", "start", "end"):  # a hand-made index holding lists
        if not hasattr(getattr(index, name), "shape"):
            raise TypeError(f"index.{name} must be an array, got {type(getattr(index, name)).__name__}")
    for name in ("num_sink", "num_local"):
        built, asked = getattr(index, name), getattr(config, name)
        if built is not None and built != asked:
            raise ValueError(f"the index was built with {name}={built} but config has {name}={asked}: "
                             f"build the index with this config")
    if index.codes.ndim == 4 and index.codes.shape[:3] == (B, Hkv, N) and index.codes.shape[3] != config.L:
        raise ValueError(f"the index was built with L={index.codes.shape[3]} tables (index.codes "
                         f"{tuple(index.codes.shape)}) but config has L={config.L}: build the index with this config")
    if (index.projections.ndim == 2 and index.projections.shape[0] == D and config.L
            and index.projections.shape[1] != config.K * config.L and index.projections.shape[1] % config.L == 0):
        raise ValueError(f"the index was built with K={index.projections.shape[1] // config.L} bits per table "
                         f"(index.projections {tuple(index.projections.shape)}) but config has K={config.K}: "
                         "build the index with this config")
    if index.codes.shape != (B, Hkv, N, config.L):
        raise ValueError(
            f"index.codes must be [B, Hkv, N, L] = {(B, Hkv, N, config.L)}, got {tuple(index.codes.shape)}"
        )
    if index.projections.shape != (D, config.K * config.L):
        raise ValueError(
            f"index.projections must be [D, K*L] = {(D, config.K * config.L)}, "
            f"got {tuple(index.projections.shape)}"
        )
    if not jnp.issubdtype(index.projections.dtype, jnp.floating):
        raise TypeError(f"index.projections must be a float array, got {index.projections.dtype}")
    for name, want in (("mean", (B, Hkv, D)), ("start", (B,)), ("end", (B,))):
        got = tuple(getattr(index, name).shape)
        if got != want:  # a hand-made index: a wrong shape would broadcast silently
            raise ValueError(f"index.{name} must be {list(want)}, got {list(got)}")


def mean_or_nan_for_projections(mean: Float[Array, "B Hkv D"], projections: Float[Array, "D KL"]
                                ) -> Float[Array, "B Hkv D"]:
    """``mean``, or NaN everywhere if a hyperplane (column) of ``projections`` is not finite or is 0.

    Such a hyperplane gives every key and query bit 0 in its tables, so the collisions, and the
    ``u`` of the keys' angles, no longer describe what was sampled: a finite but wrong estimate.
    Concrete projections are refused (ValueError); traced ones make the index's mean NaN, which
    turns every head's result NaN (:func:`nan_if_not_finite`, and the host op alike).

    Raises:
      TypeError: ``projections`` is not a float array.
      ValueError: concrete ``projections`` with a NaN or infinite entry, or an all-zero column.
    """
    if not jnp.issubdtype(projections.dtype, jnp.floating):
        raise TypeError(f"projections must be a float array (Gaussian SimHash hyperplanes), got {projections.dtype}")
    valid = jnp.all(jnp.isfinite(projections)) & jnp.all(jnp.any(projections != 0, axis=0))
    if not isinstance(valid, jax.core.Tracer):
        if not bool(valid):
            raise ValueError("projections must be finite SimHash hyperplanes, none of them 0, got a NaN or infinite "
                             "entry or an all-zero column")
        return mean
    return jnp.where(valid, mean, jnp.nan)


def nan_if_not_finite(out: Float[Array, "B Hq D"], lse: Float[Array, "B Hq"], index: LSHIndex,
                      q: Float[Array, "B Hq D"]) -> tuple[Float[Array, "B Hq D"], Float[Array, "B Hq"]]:
    """``(out, lse)`` with NaN for every query head whose query, or whose KV head's index mean,
    is not finite.

    A NaN or infinite key in the hashed range makes the mean non-finite and every centered
    code 0, so the sample carries no information: the head's result is NaN, never a silently
    wrong sample (the host op does the same). A non-finite query has no code either (a NaN
    projection gives bit 0): it samples keys by chance, or none, and with an empty static set
    would read as an empty row (out 0, lse -inf) where dense attention gives NaN.
    """
    Hq, Hkv = lse.shape[1], index.mean.shape[1]
    broken = jnp.repeat(~jnp.all(jnp.isfinite(index.mean), axis=-1), Hq // Hkv, axis=1)  # [B, Hq]
    broken = broken | ~jnp.all(jnp.isfinite(q), axis=-1)
    return jnp.where(broken[..., None], jnp.nan, out), jnp.where(broken, jnp.nan, lse)
