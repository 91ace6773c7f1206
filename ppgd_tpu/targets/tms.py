"""TMS: the toy model of superposition, x_hat = ReLU(x W [I...] W^T + b) (TOYS.md).

Tied in the target (W and W^T are the same parameter), untied in the decomposition: the
sites `linear1` = W, `hidden_layers.{i}` = I, `linear2` = W^T are decomposed separately.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ppgd_tpu import axes
from ppgd_tpu.config import TMSConfig
from ppgd_tpu.data.toy import sparse_features
from ppgd_tpu.targets.base import Target, frozen, nonfinite


class TMS(Target):
    W: jax.Array = axes.field("features", "hidden")  # [n_features, n_hidden]
    b: jax.Array = axes.field("features")  # [n_features]
    n_identity: int = eqx.field(static=True)
    feature_probability: float = eqx.field(static=True)

    def site_weights(self):
        m = self.W.shape[1]
        sites = {"linear1": self.W}
        for i in range(self.n_identity):
            sites[f"hidden_layers.{i}"] = jnp.eye(m, dtype=self.W.dtype)
        sites["linear2"] = self.W.T
        return sites

    def forward(self, inputs, site_fn):
        h = site_fn("linear1", inputs, self.W)
        eye = jnp.eye(self.W.shape[1], dtype=self.W.dtype)
        for i in range(self.n_identity):
            h = site_fn(f"hidden_layers.{i}", h, eye)
        return jax.nn.relu(site_fn("linear2", h, self.W.T) + self.b)

    @property
    def n_features(self):
        return self.W.shape[0]

    @property
    def identity_ci_sites(self):
        return ("linear1", "linear2")

    @property
    def dense_ci_sites(self):
        """Each hidden identity [m, m] is m components that sum to I."""
        return {f"hidden_layers.{i}": self.W.shape[1] for i in range(self.n_identity)}

    def sample(self, key, batch: int):
        return sparse_features(key, batch, self.W.shape[0], self.feature_probability, 0.0, 1.0)

    def labels(self, x):
        """Pretraining target: reconstruct the input."""
        return x


# The config fields that decide what given weights compute (build.load checks a file's
# recorded config against them; the others are how it was trained, or compute only).
ARCHITECTURE = ("n_features", "n_hidden", "n_identity_layers")


def init(cfg: TMSConfig, key) -> TMS:
    n, m = cfg.n_features, cfg.n_hidden
    W = jax.random.normal(key, (n, m)) * np.sqrt(2.0 / (n + m))
    return TMS(W=W, b=jnp.zeros((n,)),  # zero bias: a random one often leaves a dead feature
               n_identity=cfg.n_identity_layers, feature_probability=cfg.feature_probability)


def trainable_filter(target: TMS):
    return TMS(W=True, b=True, n_identity=target.n_identity,
               feature_probability=target.feature_probability)


def check(target: TMS, cfg: TMSConfig) -> list[str]:
    """Every weight finite, and every feature well preserved: |x_hat_i - 0.75| < tol on the
    one-hot 0.75 e_i. (Comparisons with NaN are False, so each test is written to fail on
    NaN rather than pass.)"""
    bad = nonfinite(state_dict(target))
    if bad:
        return bad
    n, tol = target.n_features, cfg.check_tol
    out = np.asarray(target.forward(0.75 * jnp.eye(n), frozen))
    if not np.all(np.isfinite(out)):
        return ["x_hat has non-finite values on the one-hot inputs 0.75 e_i (the weights "
                "overflow)"]
    diag = np.diag(out)
    return [f"feature {i}: x_hat_i = {diag[i]:.3f} on input 0.75 e_i (|x_hat_i - 0.75| must "
            f"be < target.tms.check_tol = {tol})" for i in range(n)
            if not abs(diag[i] - 0.75) < tol]


def state_dict(target: TMS) -> dict[str, jax.Array]:
    return {"W": target.W, "b": target.b}


def from_state_dict(cfg: TMSConfig, sd) -> TMS:
    return TMS(W=jnp.asarray(sd["W"]), b=jnp.asarray(sd["b"]), n_identity=cfg.n_identity_layers,
               feature_probability=cfg.feature_probability)
