"""Batch rows that cannot move a recon divergence, and running the recon without them.

A row whose every site input is exactly zero on the clean path has its masked output equal to
its clean output whatever the masks, routes or sources: `site_out(0) = ((0 V) * m) U + (0 W) d
= 0 = 0 W`, so by induction every later site sees its clean input (rows of a position-less toy
never mix). Its divergence term is 0 and so is every gradient through it (the divergence's
gradient at an output equal to the clean one is 0).

So on CPU the recon forwards of a position-less target run on the live rows only, gathered
live-first into a static number of rows sized from the probability that a row is live (the
toy's data: `Target.live_row_probability`), or on the full batch when a batch has more. The
step picks the branch with ONE `lax.switch` around its whole recon part (warmup ascents, the
losses' value and gradient): a switch per forward cost more in copies than the gathers saved.
The divergence, a mean over rows, is rescaled by k / rows: the same sum over the same live
rows, reassociated; the full-batch branch is exactly the un-gathered computation.

The CI fn (when it trains this step) runs in the same branch on the same rows plus ONE
all-zero row: a toy CI fn reads site inputs only and maps rows independently, so every dead
row has that row's CI, and imp-min counts it rows - k times (`Subset.counts`). What it saves:
`ppgd-tpu bench step`'s live-rows A/B; docs/performance-log.md."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ppgd_tpu.targets.lowrank import LowRank


class LiveRows(NamedTuple):
    order: jax.Array  # [rows] int32: the live rows in row order, then the others
    slot: jax.Array  # [rows] int32: each row's position in `order`
    size: jax.Array  # int32: index of the smallest of the sizes holding every live row


class Subset(NamedTuple):
    """The first `k` rows of `order` (k static): every live row and some dead ones; or
    `Subset.all(n)`, every row of n in place (no `order`): each method is then the identity,
    so the step runs one code path whether or not it gathers rows."""

    order: jax.Array | None
    slot: jax.Array | None
    k: int

    @classmethod
    def all(cls, n: int) -> Subset:
        """Every one of n rows, in place: nothing gathered, scale 1."""
        return cls(None, None, n)

    @property
    def indices(self) -> jax.Array | None:
        """The subset's rows of the batch (None: all of them, in place)."""
        return None if self.order is None else self.order[:self.k]

    def full_shape(self, leading: tuple[int, ...]) -> tuple[int, ...]:
        """The batch's leading shape, from the subset's `leading` one."""
        return leading if self.order is None else self.order.shape

    def share(self, mean):
        """A mean over the subset's rows as its share of the batch mean (k / rows of it)."""
        return mean if self.order is None else mean * (self.k / self.order.shape[0])

    def take(self, tree, axis: int = 0):
        """The subset's rows of every [rows, ...] leaf, rows on `axis` (a differentiable
        gather)."""
        if self.order is None:
            return tree
        at = (slice(None),) * axis + (self.indices,)
        return _map_rows(lambda a: a[at], tree, self.order.shape[0], axis)

    def put(self, tree, outside):
        """The batch's tree: `tree` (on the subset's rows) on the subset's rows, `outside()`
        (on every row) on the others; leaves without rows are `tree`'s. A gather and a
        select, not a scatter: XLA:CPU fuses them with whatever computes `outside()` into
        one pass per leaf."""
        if self.order is None:
            return tree
        n = self.order.shape[0]
        inside = self.slot < self.k
        at = jnp.minimum(self.slot, self.k - 1)

        def put(f, t):
            if not (f.ndim and f.shape[0] == n):
                return t
            return jnp.where(inside.reshape(-1, *[1] * (f.ndim - 1)), t[at], f)
        return jax.tree.map(put, outside(), tree)

    def take_and_zero_row(self, tree):
        """The subset's rows of every [rows, ...] leaf, then one all-zero row: it stands for
        the batch's other rows, all dead (every site input zero), so for the CI fn's taps."""
        if self.order is None:
            return tree
        return _map_rows(lambda a: jnp.concatenate([a[self.indices], jnp.zeros_like(a[:1])]),
                         tree, self.order.shape[0])

    def head(self, tree):
        """The first k rows of each leaf of a tree made on `take_and_zero_row` rows: the
        subset's own."""
        if self.order is None:
            return tree
        return {s: v[:self.k] for s, v in tree.items()}

    @property
    def counts(self) -> np.ndarray | None:
        """How many batch rows each row of `take_and_zero_row` stands for (None: one each)."""
        if self.order is None:
            return None
        return np.append(np.ones(self.k, np.float32), np.float32(self.order.shape[0] - self.k))


def _map_rows(fn, tree, n: int, axis: int = 0):
    """`fn` on every leaf of `tree` with n rows on `axis`. A factored activation
    (targets/lowrank.py) has its rows in its coefficients; its bases are weights, whatever
    their first dimension."""
    def one(x):
        if isinstance(x, LowRank):
            return LowRank(tuple(fn(a) for a in x.coeffs), x.bases)
        return fn(x) if x.ndim > axis and x.shape[axis] == n else x
    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, LowRank))


def rows_before(live):
    """Live rows before each row of `live` [rows] (an exclusive prefix count), as two small
    triangular matmuls over a [rows / b, b] view: XLA:CPU lowers a cumsum (which
    `jnp.nonzero` runs twice) as dozens of reduce-windows. 0/1 sums below 2**24 are exact
    in fp32."""
    rows = live.shape[0]
    b = max(8, math.ceil(math.sqrt(rows) / 8) * 8)
    nb = -(-rows // b)
    x = jnp.pad(live.astype(jnp.float32), (0, nb * b - rows)).reshape(nb, b)
    dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
    within = dot(x, jnp.triu(jnp.ones((b, b), jnp.float32), 1))  # [i, j]: live x[i, :j]
    earlier = dot(jnp.sum(x, 1), jnp.triu(jnp.ones((nb, nb), jnp.float32), 1))
    return (within + earlier[:, None]).reshape(-1)[:rows].astype(jnp.int32)


def sizes(rows: int, p_live: float | None) -> tuple[int, ...]:
    """The static row counts a recon may run on: the batch, and before it (when a row is live
    with known probability `p_live`) a binomial mean + 6 sd bound on the live rows, a
    multiple of 8, if that is at most half the batch. One extra branch only: each compiles
    the whole recon part. Above half the gathers, the scatters of their gradients and the
    switch's copies cost more than the rows save."""
    if p_live is None:
        return (rows,)
    mean = rows * p_live
    k = -(-math.ceil(mean + 6.0 * math.sqrt(mean * (1.0 - p_live))) // 8) * 8
    return (k, rows) if k <= rows // 2 else (rows,)


def find(taps: dict, sizes_: tuple[int, ...]) -> LiveRows:
    """Site inputs on the clean path ([rows, d], or factored: a row is taken as live when any
    factor's row is nonzero) -> the live-first order and the index of the size to run at."""
    rows = sizes_[-1]
    live = jnp.zeros((rows,), bool)
    for x in taps.values():
        for a in (x.coeffs if isinstance(x, LowRank) else (x,)):
            live = live | jnp.any(a.reshape(rows, -1) != 0, axis=-1)
    order, slot, n_live = live_first(live)
    size = jnp.sum(n_live > jnp.array(sizes_[:-1], jnp.int32), dtype=jnp.int32)
    return LiveRows(order=order, slot=slot, size=size)


def live_first(live):
    """The row indices of `live` [rows] (bool), live rows first, each group in row order;
    each row's position in that order; the number of live rows."""
    before = rows_before(live)
    row = jnp.arange(live.shape[0], dtype=jnp.int32)
    n_live = before[-1] + live[-1]
    slot = jnp.where(live, before, n_live + row - before)
    return jnp.zeros_like(row).at[slot].set(row, unique_indices=True), slot, n_live


def switch(live: LiveRows, sizes_: tuple[int, ...], fn):
    """`fn(subset)` at the smallest size holding every live row: one compiled branch per size,
    the full batch (`Subset.all`: nothing gathered) the last."""
    n = sizes_[-1]
    branches = [functools.partial(fn, Subset.all(n) if k == n else Subset(live.order, live.slot, k))
                for k in sizes_]
    return jax.lax.switch(live.size, branches)
