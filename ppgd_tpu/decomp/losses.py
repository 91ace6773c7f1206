"""Losses of SPEC 4: importance minimality, the stochastic recon plans (the divergences
they score are in divergence.py).

Everything here is math on the GLOBAL batch; reductions run in fp32 [N1-N3].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ppgd_tpu.config import ImpMinConfig, StochasticTerm
from ppgd_tpu.decomp import rng
from ppgd_tpu.decomp.live_rows import Subset
from ppgd_tpu.targets.base import MaskThunk, SiteMask


# ---------------------------------------------------------------- importance minimality


def imp_min(upper: dict[str, jax.Array], cfg: ImpMinConfig, p, gamma, counts=None):
    """[S7, S8] returns (contribution, lp, freq).

    f[s, c] = Σ_leading ψ(upper[..., c]) / n_positions over the global batch; the frequency
    term puts the exact global f inside the log2 [D2]. With `counts` (a numpy [rows]
    array) row r of a [rows, C] upper stands for counts[r] identical rows of the batch.
    """
    lp = jnp.float32(0.0)
    freq = jnp.float32(0.0)
    for u in upper.values():
        u = u.astype(jnp.float32)
        if cfg.kind == "lp":
            psi = (u + cfg.eps) ** p
        else:
            psi = jnp.square(u) / (jnp.square(u) + jnp.square(gamma))
        psi = psi.reshape(-1, u.shape[-1])
        if counts is None:
            f = jnp.sum(psi, axis=0) / psi.shape[0]
        else:
            f = jnp.sum(psi * counts[:, None], axis=0) / float(counts.sum())
        lp = lp + jnp.sum(f)
        if cfg.freq_coeff > 0:
            freq = freq + jnp.sum(f * jnp.log2(1.0 + cfg.reference_token_count * f))
    contribution = cfg.coeff * lp + (cfg.freq_coeff * freq if cfg.freq_coeff > 0 else 0.0)
    return contribution, lp, freq


# ---------------------------------------------------------------- masks from sources


def mask_from_source(lower, source, use_delta: bool) -> SiteMask:
    """SPEC 1: mask = lower + (1 - lower) * source[..., :C]; delta mask = source[..., C] raw.

    One split, not two slices: the gradient w.r.t. the source (the adversary's) is then one
    concatenate instead of two zero-padded copies and their sum."""
    C = lower.shape[-1]
    src, delta = jnp.split(source, [C], axis=-1)
    mask = lower + (1.0 - lower) * src
    return SiteMask(mask=mask, delta=delta[..., 0] if use_delta else None)


def uniform_k_routes(key, leading: tuple[int, ...], n_live: int) -> jax.Array:
    """[S11] per position k ~ U{1..n_live}, then a uniform k-subset of the live sites.

    Returns bool [n_live, *leading]: site i is routed where its rank in a random
    permutation is < k.
    """
    k_k, k_perm = jax.random.split(key)
    k = jax.random.randint(k_k, leading, 1, n_live + 1)
    scores = rng.uniform(k_perm, (n_live, *leading))
    rank = jnp.argsort(jnp.argsort(scores, axis=0), axis=0)
    return rank < k[None]


def stochastic_plan(term: StochasticTerm, sites: tuple[str, ...]) -> list[tuple[str, ...]]:
    """[S10] the static plan: one entry of all sites, or sequential chunks of n sites."""
    if term.plan == "all":
        return [sites]
    n = term.chunk_size
    return [sites[i:i + n] for i in range(0, len(sites), n)]


def stochastic_masks(key, lower: dict[str, jax.Array], live: tuple[str, ...], routing: str,
                     use_delta: bool, rows: Subset) -> dict[str, MaskThunk]:
    """Masks of one stochastic draw: fresh U[0,1] sources per site, position and channel,
    as thunks drawn inside the forward at each site (only the joint uniform_k routes, one
    bool per site and position, are drawn up front). `lower` holds the batch's `rows`
    (`Subset.all`: every row) and only their draws are made (the same values as theirs in
    the full draw)."""
    full = rows.full_shape(next(iter(lower.values())).shape[:-1])
    routes = rows.take(uniform_k_routes(jax.random.fold_in(key, 1 << 20), full, len(live)),
                       axis=1) if routing == "uniform_k" else None
    return {s: functools.partial(_stochastic_site_mask, jax.random.fold_in(key, i), lower[s],
                                 use_delta, None if routes is None else routes[i], full,
                                 rows.indices)
            for i, s in enumerate(live)}


def _stochastic_site_mask(key, lower, use_delta: bool, route, full, rows) -> SiteMask:
    src = rng.uniform(key, (*full, lower.shape[-1] + 1), rows=rows, once=True)
    return mask_from_source(lower, jax.lax.optimization_barrier(src), use_delta)._replace(
        route=route)


def stochastic_recon(key, term: StochasticTerm, plan, lower, recon_fn, use_delta: bool,
                     rows: Subset):
    """[S10] mean over ALL forwards (plan entries x draws) of the divergence.

    `recon_fn(masks) -> divergence` runs one masked forward against the clean output;
    `lower` and `recon_fn` are on the batch's `rows` (`Subset.all`: every row).
    """
    total = jnp.float32(0.0)
    n = 0
    for e, live in enumerate(plan):
        for d in range(term.n_draws):
            k = jax.random.fold_in(jax.random.fold_in(key, e), d)
            total = total + recon_fn(stochastic_masks(k, lower, live, term.routing, use_delta,
                                                      rows))
            n += 1
    return total / n
