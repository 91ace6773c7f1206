"""Activations kept as a sum of products, `x = sum_i a_i @ B_i`, never formed.

A residual stream that is written only by linear maps of narrow activations (ResidMLP:
x @ W_E with 100 features, MLP outputs from 50 neurons or C components into d_embed = 1000)
is low-rank per row. Kept factored, every `x @ M` costs rows x k_i x d_M plus a
batch-independent B_i @ M, instead of rows x d_embed x d_M; `ppgd-tpu bench step` on
configs/bench/resid_mlp1_ref.yaml measures what it saves. The maths is unchanged up to
float reassociation.

`site_out` (targets/base.py) is written against the three operations used here (`@`, `+`,
row scaling) plus `lift` / `select_rows` / `dense`, so it runs on plain arrays bit for bit as
before and on factored activations lazily.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class LowRank(NamedTuple):
    """x = sum_i coeffs[i] @ bases[i]; a basis None is the identity (x = coeffs[i])."""

    coeffs: tuple[jax.Array, ...]  # [*lead, k_i]
    bases: tuple[jax.Array | None, ...]  # [k_i, d]

    @classmethod
    def of(cls, a: jax.Array) -> "LowRank":
        return cls((a,), (None,))

    def __matmul__(self, M: jax.Array) -> "LowRank":
        return LowRank(self.coeffs, tuple(M if B is None else B @ M for B in self.bases))

    def __add__(self, other: "LowRank") -> "LowRank":
        return LowRank(self.coeffs + other.coeffs, self.bases + other.bases)

    def __mul__(self, s: jax.Array) -> "LowRank":
        """Row scaling by s [*lead, 1] (a per-row mask)."""
        return LowRank(tuple(a * s for a in self.coeffs), self.bases)

    def dense(self) -> jax.Array:
        out = None
        for a, B in zip(self.coeffs, self.bases):
            y = a if B is None else a @ B
            out = y if out is None else out + y
        return out


def linear(x, W: jax.Array):
    """x @ W over x's last dim. An activation with several leading dims ([B, T, d]) is
    multiplied as ONE 2-D matmul [rows, d_in] x [d_in, d_out]: its weight gradient then
    contracts one dim, where over B and T XLA:CPU first copies the [B, T, d_out] cotangent
    into a transposed layout (docs/performance-log.md). The same product; a factored x stays
    lazy."""
    if isinstance(x, LowRank) or x.ndim <= 2:
        return x @ W
    return (x.reshape(-1, x.shape[-1]) @ W).reshape(*x.shape[:-1], W.shape[-1])


def dense(x):
    """x as a plain array."""
    return x.dense() if isinstance(x, LowRank) else x


def lift(a: jax.Array, like):
    """a in the representation of `like`: factored (so `a @ U` stays lazy) when like is."""
    return LowRank.of(a) if isinstance(like, LowRank) else a


def select_rows(keep: jax.Array, x, y):
    """Rows of x where keep [*lead, 1] (bool), of y elsewhere."""
    if isinstance(x, LowRank) or isinstance(y, LowRank):
        k = keep.astype(x.coeffs[0].dtype if isinstance(x, LowRank) else x.dtype)
        as_lr = lambda v: v if isinstance(v, LowRank) else LowRank.of(v)
        return as_lr(x) * k + as_lr(y) * (1 - k)
    return jnp.where(keep, x, y)
