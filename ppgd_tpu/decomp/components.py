"""Rank-1 components per site (SPEC 1): V_s [d_in, C_s], U_s [C_s, d_out], fp32 masters."""

from __future__ import annotations

import fnmatch

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ppgd_tpu import axes
from ppgd_tpu.config import ConfigError
from ppgd_tpu.decomp import rng


class Components(eqx.Module):
    V: dict[str, jax.Array] = axes.field("embed", "channels")  # V_s [d_in, C_s]
    U: dict[str, jax.Array] = axes.field("channels", "embed")  # U_s [C_s, d_out]

    @property
    def sites(self) -> tuple[str, ...]:
        return tuple(self.V)


def resolve_sites(patterns: dict[str, int], site_names) -> dict[str, int]:
    """{site: C} for every target site matched by a pattern, in the target's canonical order.

    An exact name beats a glob, and the first matching glob beats later ones. A pattern
    that decides no site is refused: one matching nothing (a typo would otherwise silently
    leave a site undecomposed), and one whose every site an earlier pattern decides (its C
    would silently not apply: a command-line override comes after the config's patterns).
    """
    out, decided_by = {}, {}
    for pat in patterns:
        if not any(fnmatch.fnmatchcase(s, pat) for s in site_names):
            raise ConfigError(f"decomp.sites.{pat}: matches no site of this target; "
                              f"its sites are {', '.join(site_names)}")
    for s in site_names:
        pat = s if s in patterns else next(
            (p for p in patterns if fnmatch.fnmatchcase(s, p)), None)
        if pat is not None:
            out[s], decided_by[s] = patterns[pat], pat
    for pat in patterns:
        if pat not in decided_by.values():
            hits = [s for s in site_names if fnmatch.fnmatchcase(s, pat)]
            winners = ", ".join(f"{s} by {decided_by[s]!r}" for s in hits)
            raise ConfigError(
                f"decomp.sites.{pat}: decides no site: each one it matches is decided by an "
                f"exact name or an earlier pattern ({winners}); remove it, or name the sites "
                "exactly")
    return out


def resolve_ties(ties: dict[str, str], C: dict[str, int],
                 shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """{tied site: source site}, checked: both decomposed, a source is not itself tied, and the
    tied site's weight is the source's transposed with the same C (so V = U_src^T fits)."""
    for t, src in ties.items():
        path = f"decomp.tie.{t}"
        for s in (t, src):
            if s not in C:
                raise ConfigError(f"{path}: {s!r} is not a decomposed site; they are "
                                  f"{', '.join(C)}")
        if t == src or src in ties:
            raise ConfigError(f"{path}: {src!r} is itself tied; a source must be an untied site "
                              f"(tied sites: {', '.join(ties)})")
        if tuple(shapes[t]) != tuple(shapes[src])[::-1] or C[t] != C[src]:
            raise ConfigError(
                f"{path}: {t} (weight {tuple(shapes[t])}, C = {C[t]}) cannot share {src}'s "
                f"components (weight {tuple(shapes[src])}, C = {C[src]}): it needs the "
                "transposed weight shape and the same C")
    return dict(ties)


def tie(components: Components, ties: dict[str, str]) -> Components:
    """A tied site's components are its source's transposed: V_t = U_src^T, U_t = V_src^T
    (the reference's `tied_weights`, for TMS's W / W^T). Its own values are never trained."""
    if not ties:
        return components
    V, U = dict(components.V), dict(components.U)
    for t, src in ties.items():
        V[t], U[t] = components.U[src].T, components.V[src].T
    return Components(V=V, U=U)


def tie_grads(grads: Components, ties: dict[str, str]) -> Components:
    """The gradient w.r.t. the shared parameters: a tied site's V/U gradients, transposed, add
    onto its source's U/V (the chain rule through `tie`); the tied site's own are zero."""
    if not ties:
        return grads
    V, U = dict(grads.V), dict(grads.U)
    for t, src in ties.items():
        U[src] = U[src] + grads.V[t].T
        V[src] = V[src] + grads.U[t].T
        V[t], U[t] = jnp.zeros_like(grads.V[t]), jnp.zeros_like(grads.U[t])
    return Components(V=V, U=U)


def init(key, weights: dict[str, jax.Array], C: dict[str, int]) -> Components:
    """V ~ N(0, 1/d_in), U ~ N(0, 1/C): V U starts small and the [S21] warmup or the
    faithfulness term pulls it onto W."""
    V, U = {}, {}
    for i, (s, c) in enumerate(C.items()):
        d_in, d_out = weights[s].shape
        kv, ku = jax.random.split(jax.random.fold_in(key, i))
        V[s] = rng.normal(kv, (d_in, c)) / np.sqrt(d_in)
        U[s] = rng.normal(ku, (c, d_out)) / np.sqrt(c)
    return Components(V=V, U=U)


def faithfulness(components: Components, weights: dict[str, jax.Array]):
    """[S17] Σ_s ||W_s - V_s U_s||_F² / Σ_s numel(W_s), fp32."""
    num = sum(jnp.sum(jnp.square(weights[s].astype(jnp.float32) - components.V[s] @ components.U[s]))
              for s in components.V)
    den = sum(weights[s].size for s in components.V)
    return num / den
