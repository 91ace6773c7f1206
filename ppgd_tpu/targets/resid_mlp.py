"""ResidMLP ("compressed computation", TOYS.md): r = x W_E; r += ReLU(r W_in) W_out; out = r W_E^T.

W_E is fixed random with unit-norm rows and never trained; labels are y = x + ReLU(x).
Sites: `layers.{i}.mlp_in` [d_embed, d_mlp], `layers.{i}.mlp_out` [d_mlp, d_embed].
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ppgd_tpu import axes
from ppgd_tpu.config import ResidMLPConfig
from ppgd_tpu.data.toy import sparse_features
from ppgd_tpu.targets.base import Target, frozen, nonfinite
from ppgd_tpu.targets.lowrank import LowRank, dense


class ResidMLP(Target):
    W_E: jax.Array = axes.field("features", "embed")  # [n_features, d_embed], unit-norm rows
    W_in: tuple[jax.Array, ...] = axes.field("embed", "hidden")  # per layer [d_embed, d_mlp]
    W_out: tuple[jax.Array, ...] = axes.field("hidden", "embed")  # per layer [d_mlp, d_embed]
    feature_probability: float = eqx.field(static=True)

    def site_weights(self):
        sites = {}
        for i, (w_in, w_out) in enumerate(zip(self.W_in, self.W_out)):
            sites[f"layers.{i}.mlp_in"] = w_in
            sites[f"layers.{i}.mlp_out"] = w_out
        return sites

    def forward(self, inputs, site_fn):
        """The residual stream stays factored (targets/lowrank.py): it is x @ W_E plus MLP
        outputs of rank <= d_mlp (or C), so no [B, d_embed] activation is ever formed; a
        site sees a LowRank input and `site_fn` keeps its output lazy."""
        r = LowRank.of(inputs) @ self.W_E
        for i, (w_in, w_out) in enumerate(zip(self.W_in, self.W_out)):
            h = jax.nn.relu(dense(site_fn(f"layers.{i}.mlp_in", r, w_in)))
            r = r + site_fn(f"layers.{i}.mlp_out", LowRank.of(h), w_out)
        return dense(r @ self.W_E.T)

    @property
    def n_features(self):
        return self.W_E.shape[0]

    @property
    def identity_ci_sites(self):
        """Every layer's mlp_in reads each feature's direction off the residual stream: one
        component per feature in each (the reference's IdentityCIError on layers.*.mlp_in)."""
        return tuple(f"layers.{i}.mlp_in" for i in range(len(self.W_in)))

    @property
    def dense_ci_sites(self):
        """Each W_out is one rank-d_mlp mechanism (SPD paper, Fig. 8)."""
        return {f"layers.{i}.mlp_out": w.shape[0] for i, w in enumerate(self.W_out)}

    @property
    def neuron_input_sites(self):
        return tuple(f"layers.{i}.mlp_out" for i in range(len(self.W_out)))

    def sample(self, key, batch: int):
        return sparse_features(key, batch, self.n_features, self.feature_probability, -1.0, 1.0)

    def labels(self, x):
        return x + jax.nn.relu(x)


# The config fields that decide what given weights compute (build.load checks a file's
# recorded config against them; the others are how it was trained, or compute only).
ARCHITECTURE = ("n_features", "d_embed", "d_mlp", "n_layers")


def init(cfg: ResidMLPConfig, key) -> ResidMLP:
    k_e, *ks = jax.random.split(key, 1 + 2 * cfg.n_layers)
    W_E = jax.random.normal(k_e, (cfg.n_features, cfg.d_embed))
    W_E = W_E / jnp.linalg.norm(W_E, axis=1, keepdims=True)
    w_in = tuple(jax.random.normal(ks[2 * i], (cfg.d_embed, cfg.d_mlp)) / np.sqrt(cfg.d_embed)
                 for i in range(cfg.n_layers))
    w_out = tuple(jax.random.normal(ks[2 * i + 1], (cfg.d_mlp, cfg.d_embed)) / np.sqrt(cfg.d_mlp)
                  for i in range(cfg.n_layers))
    return ResidMLP(W_E=W_E, W_in=w_in, W_out=w_out, feature_probability=cfg.feature_probability)


def trainable_filter(target: ResidMLP):
    return ResidMLP(W_E=False, W_in=tuple(True for _ in target.W_in),
                    W_out=tuple(True for _ in target.W_out),
                    feature_probability=target.feature_probability)


def monosemantic_baseline(target: ResidMLP) -> float:
    """MSE of implementing one feature per neuron and dropping the rest:
    (1 - neurons / features) * p * E[ReLU(x)^2], E[ReLU(x)^2] = 1/6 for x ~ U[-1, 1]."""
    neurons = sum(w.shape[1] for w in target.W_in)
    dropped = max(0.0, 1.0 - neurons / target.n_features)
    return dropped * target.feature_probability / 6.0


def check(target: ResidMLP, cfg: ResidMLPConfig) -> list[str]:
    """Every weight finite, and the read-off MSE below the monosemantic baseline (TOYS.md)."""
    bad = nonfinite(state_dict(target))
    if bad:
        return bad
    x = target.sample(jax.random.key(1234), 20000)
    out = target.forward(x, frozen)
    mse = float(jnp.mean(jnp.square(out - target.labels(x))))
    if not np.isfinite(mse):
        return [f"read-off MSE is {mse}: the outputs have non-finite values (the weights "
                "overflow)"]
    base = monosemantic_baseline(target)
    return [] if mse < base else [
        f"read-off MSE {mse:.3e} is not below the monosemantic baseline {base:.3e}"]


def state_dict(target: ResidMLP) -> dict[str, jax.Array]:
    sd = {"W_E": target.W_E}
    sd.update(target.site_weights())
    return sd


def from_state_dict(cfg: ResidMLPConfig, sd) -> ResidMLP:
    L = cfg.n_layers
    return ResidMLP(W_E=jnp.asarray(sd["W_E"]),
                    W_in=tuple(jnp.asarray(sd[f"layers.{i}.mlp_in"]) for i in range(L)),
                    W_out=tuple(jnp.asarray(sd[f"layers.{i}.mlp_out"]) for i in range(L)),
                    feature_probability=cfg.feature_probability)
