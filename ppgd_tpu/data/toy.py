"""Sparse-feature batches for the toy targets (TOYS.md).

Each feature is independently active with probability p; an active value is U[lo, hi].
Batch j is a pure function of (key, j) [R1], so any step can be replayed or resumed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ppgd_tpu.config import Config, ConfigError
from ppgd_tpu.decomp import rng

DATA_TAG = 0x5EED  # fold_in index separating data draws from training draws
EVAL_TAG = 0xE7A1  # fold_in index of eval draws (the eval batch, the eval masks)


def sparse_features(key, batch: int, n: int, p: float, lo: float, hi: float):
    """jax.random's `bernoulli(k_on, p)` and `uniform(k_val, lo, hi)` bit for bit, drawn by
    `rng`'s cheaper threefry [R1]."""
    k_on, k_val = jax.random.split(key)
    on = rng.uniform(k_on, (batch, n)) < p
    val = rng.uniform(k_val, (batch, n), minval=lo, maxval=hi)
    return jnp.where(on, val, 0.0)


def batch_key(seed: int, j):
    """Key of data batch j under run seed `seed`."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), DATA_TAG), j)


class ToyData:
    """A toy run's data: sparse-feature batches generated on the device from (seed, j)."""

    LM_KINDS = ("llama_simple_mlp",)  # the targets that read a token store instead

    def __init__(self, cfg: Config, target, rows=None):
        """`rows(shape)`: the row sharding batches are drawn onto (None: default device).
        Drawn inside a jit sharded by rows, each process computes only its own rows, and
        partitionable threefry makes them the rows of the unsharded draw [R1, D3]."""
        if cfg.data.store:
            raise ConfigError(
                f"data.store: {cfg.data.store!r} is set, but target.kind {cfg.target.kind!r} "
                "generates its own data; a token store is read only by LM targets "
                f"({', '.join(self.LM_KINDS)}); drop --data.store")
        B = cfg.data.batch_size
        self.batch_shape = (B, target.n_features)
        B_eval, n = cfg.eval.batch_size, target.n_features
        on = (lambda shape: {}) if rows is None else (lambda shape: {"out_shardings": rows(shape)})
        sample = target.sample  # toy samplers read shapes only: no weights in the HLO
        self.batch = jax.jit(lambda j: sample(batch_key(cfg.seed, j), B), **on((B, n)))
        self.eval_batch = jax.jit(lambda: sample(
            jax.random.fold_in(batch_key(cfg.seed, 0), EVAL_TAG), B_eval), **on((B_eval, n)))()
        self.eval_labels = None
