"""Causal importance (SPEC 3): the two leaky-hard squashings and the toy CI fn families.

A CI fn maps taps (clean-path activations, named by `input_names`) to per-site logits
`[*leading, C_s]`; `ci_from_logits` is the ONE constructor of `{logits, lower, upper}` [S5].
The per-component family reads x @ V[:, c]; like the SPD reference it lets the CI path
carry gradient into V unless `detach_inputs` (then CI is a function of the taps alone, which
the replay modes need so that a constant envelope gives components the backward a live one
would [W3]). Every other family reads taps only.
"""

from __future__ import annotations

from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ppgd_tpu import axes
from ppgd_tpu.config import CIFnConfig
from ppgd_tpu.decomp import rng
from ppgd_tpu.decomp.component_mlp import site_mlps
from ppgd_tpu.targets.lowrank import dense

LEAK = 0.01


@jax.custom_vjp
def lower_leaky_hard(x):
    """[S6] forward clamp(x, 0, 1)."""
    return jnp.clip(x, 0.0, 1.0)


def _lower_fwd(x):
    return lower_leaky_hard(x), x


def _lower_bwd(x, g):
    # [S6] g on 0 < x <= 1; at x <= 0 (the tie x = 0 included): LEAK*g where g < 0, else 0;
    # at x > 1: 0.
    inside = (x > 0) & (x <= 1)
    below = (x <= 0) & (g < 0)
    return (jnp.where(inside, g, jnp.where(below, LEAK * g, jnp.zeros_like(g))),)


lower_leaky_hard.defvjp(_lower_fwd, _lower_bwd)


def upper_leaky_hard(x):
    """[S6] x > 1 ? 1 + LEAK (x - 1) : clamp(x, 0, 1); ordinary autodiff."""
    return jnp.where(x > 1, 1.0 + LEAK * (x - 1.0), jnp.clip(x, 0.0, 1.0))


class CI(NamedTuple):
    logits: dict[str, jax.Array]
    lower: dict[str, jax.Array]
    upper: dict[str, jax.Array]


def ci_from_logits(logits: dict[str, jax.Array]) -> CI:
    """[S5] the one place the squashings are applied."""
    return CI(logits=logits,
              lower={s: lower_leaky_hard(v) for s, v in logits.items()},
              upper={s: upper_leaky_hard(v) for s, v in logits.items()})


# ---------------------------------------------------------------- families


def _normal(key, shape, fan_in):
    return rng.normal(key, shape) * np.sqrt(2.0 / fan_in)


class PerComponentMLP(eqx.Module):
    """SPD's CI fn: component c's logit from its own inner activation x @ V[:, c] through a
    1 -> h -> 1 GELU MLP with its own weights (all components of a site vectorised)."""

    w1: dict[str, jax.Array] = axes.field("channels", "hidden")  # [C, h]
    b1: dict[str, jax.Array] = axes.field("channels", "hidden")  # [C, h]
    w2: dict[str, jax.Array] = axes.field("channels", "hidden")  # [C, h]
    b2: dict[str, jax.Array] = axes.field("channels")  # [C]
    detach_inputs: bool = eqx.field(static=True)

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(self.w1)

    @property
    def grads_into_components(self) -> bool:
        """Whether CI carries gradient into the components."""
        return not self.detach_inputs

    def __call__(self, taps, components):
        acts = {}
        for s in self.w1:
            V = jax.lax.stop_gradient(components.V[s]) if self.detach_inputs else components.V[s]
            acts[s] = dense(taps[s] @ V)
        return site_mlps(acts, self.w1, self.b1, self.w2, self.b2)


class PerSiteMLP(eqx.Module):
    """A d_in -> h -> C GELU MLP per site, reading the site's input."""

    w1: dict[str, jax.Array] = axes.field("embed", "hidden")  # [d_in, h]
    b1: dict[str, jax.Array] = axes.field("hidden")
    w2: dict[str, jax.Array] = axes.field("hidden", "channels")  # [h, C]
    b2: dict[str, jax.Array] = axes.field("channels")

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(self.w1)

    def __call__(self, taps, components):
        return {s: jax.nn.gelu(dense(taps[s] @ self.w1[s]) + self.b1[s]) @ self.w2[s] + self.b2[s]
                for s in self.w1}


class GlobalMLP(eqx.Module):
    """One GELU MLP over the concatenation of every site's input, split into per-site logits."""

    w1: jax.Array = axes.field("embed", "hidden")  # [sum d_in, h]
    b1: jax.Array = axes.field("hidden")
    w2: jax.Array = axes.field("hidden", "channels")  # [h, sum C]
    b2: jax.Array = axes.field("channels")
    sites: tuple[str, ...] = eqx.field(static=True)
    widths: tuple[int, ...] = eqx.field(static=True)

    @property
    def input_names(self) -> tuple[str, ...]:
        return self.sites

    def __call__(self, taps, components):
        x = jnp.concatenate([dense(taps[s]) for s in self.sites], axis=-1)
        y = jax.nn.gelu(x @ self.w1 + self.b1) @ self.w2 + self.b2
        return dict(zip(self.sites, jnp.split(y, np.cumsum(self.widths)[:-1], axis=-1)))


def reads_V(kind: str) -> bool:
    """Whether a family's CI values depend on the components (V), not on the taps alone."""
    return kind == "per_component_mlp"


def init(cfg: CIFnConfig, key, d_in: dict[str, int], C: dict[str, int]):
    """CI fn of family `cfg.kind` for sites `C` (canonical order) with input widths `d_in`
    (tap name -> width: every site's input, plus the target's other taps such as `resid.{L}`)."""
    if cfg.kind == "chunkwise_transformer":
        from ppgd_tpu.decomp import ci_transformer

        return ci_transformer.init(cfg, key, d_in, C)
    h = cfg.hidden
    sites = tuple(C)
    ks = {s: jax.random.split(jax.random.fold_in(key, i), 2) for i, s in enumerate(sites)}
    if cfg.kind == "per_component_mlp":
        return PerComponentMLP(
            w1={s: _normal(ks[s][0], (C[s], h), 1) for s in sites},
            b1={s: jnp.zeros((C[s], h)) for s in sites},
            w2={s: _normal(ks[s][1], (C[s], h), h) for s in sites},
            b2={s: jnp.zeros((C[s],)) for s in sites},
            detach_inputs=cfg.detach_inputs)
    if cfg.kind == "per_site_mlp":
        return PerSiteMLP(
            w1={s: _normal(ks[s][0], (d_in[s], h), d_in[s]) for s in sites},
            b1={s: jnp.zeros((h,)) for s in sites},
            w2={s: _normal(ks[s][1], (h, C[s]), h) for s in sites},
            b2={s: jnp.zeros((C[s],)) for s in sites})
    total_in, total_c = sum(d_in[s] for s in sites), sum(C[s] for s in sites)
    k1, k2 = jax.random.split(key)
    return GlobalMLP(w1=_normal(k1, (total_in, h), total_in), b1=jnp.zeros((h,)),
                     w2=_normal(k2, (h, total_c), h), b2=jnp.zeros((total_c,)),
                     sites=sites, widths=tuple(C[s] for s in sites))
