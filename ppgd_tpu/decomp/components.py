"""Rank-1 components per site (SPEC 1): V_s [d_in, C_s], U_s [C_s, d_out], fp32 masters."""

from __future__ import annotations

import fnmatch

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ppgd_tpu.config import ConfigError
from ppgd_tpu.decomp import rng


class Components(eqx.Module):
    V: dict[str, jax.Array]
    U: dict[str, jax.Array]

    @property
    def sites(self) -> tuple[str, ...]:
        return tuple(self.V)


def resolve_sites(patterns: dict[str, int], site_names) -> dict[str, int]:
    """{site: C} for every target site matched by a pattern, in the target's canonical order.

    An exact name beats a glob; a pattern matching nothing is refused (a typo would
    otherwise silently leave a site undecomposed).
    """
    out = {}
    for pat, c in patterns.items():
        hits = [s for s in site_names if fnmatch.fnmatchcase(s, pat)]
        if not hits:
            raise ConfigError(f"decomp.sites.{pat}: matches no site of this target; "
                              f"its sites are {', '.join(site_names)}")
    for s in site_names:
        if s in patterns:
            out[s] = patterns[s]
            continue
        for pat, c in patterns.items():
            if fnmatch.fnmatchcase(s, pat):
                out[s] = c
                break
    return out


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
