"""The decomposition's random draws, bit-identical to `jax.random.uniform` / `normal` but cheaper.

Contract [R1]: every draw is a pure function of (key, flat element index), bit-identical
to JAX's own (tests/test_math.py), so no trajectory depends on which of the two drew it or on
how the drawn array is sharded.

Uniforms are written as plain jnp integer ops (below). Normals are drawn flat and reshaped:
threefry's counter is the element's flat index either way, and XLA:CPU compiles JAX's draw
over a rank-3+ shape far slower than over the same elements flat.

The stochastic masks draw B x (C + 1) uniforms per masked site and forward. JAX lowers its
threefry hash on CPU as a rolled 5-iteration loop whose carries are copied every iteration;
the same hash unrolled here fuses into one elementwise loop. On CPU each mask draw is also
materialised once (`uniform(once=True)`): XLA:CPU otherwise recomputes the hash in every
fusion reading the mask. The toy batches (data/toy.py) draw their on/off and values the same
way, each read once.
Keys stay JAX's (`fold_in`, `split`): their rolled loop materialises each key, whereas an
unrolled key hash is a cheap scalar producer that XLA fuses into every element of the draws
consuming it.
Keys of another PRNG implementation, or JAX's non-partitionable threefry mode, fall back to
`jax.random.uniform`. What each choice measured: docs/performance-log.md.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ppgd_tpu import tracing

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_PARITY = np.uint32(0x1BD11BDA)


def _threefry2x32(k1, k2, x0, x1):
    """Threefry-2x32 with 20 rounds (Salmon et al. 2011), as JAX's `threefry2x32_p`."""
    ks = (k1, k2, k1 ^ k2 ^ _PARITY)
    x0, x1 = x0 + ks[0], x1 + ks[1]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x0 = x0 + x1
            x1 = x0 ^ ((x1 << np.uint32(r)) | (x1 >> np.uint32(32 - r)))
        x0 = x0 + ks[(i + 1) % 3]
        x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x0, x1


def _is_threefry(key) -> bool:
    return (str(jax.random.key_impl(key)) == "threefry2x32"
            and jax.config.jax_threefry_partitionable)


def normal(key, shape: tuple[int, ...]) -> jax.Array:
    """float32 N(0, 1) of `shape` from a typed key; == jax.random.normal(key, shape)."""
    if not _is_threefry(key):
        return jax.random.normal(key, shape)
    return jax.random.normal(key, (math.prod(shape),)).reshape(shape)


def uniform(key, shape: tuple[int, ...], minval: float = 0.0, maxval: float = 1.0,
            rows: jax.Array | None = None, once: bool = False) -> jax.Array:
    """float32 U[minval, maxval) of `shape` from a typed threefry key;
    == jax.random.uniform(key, shape, minval=minval, maxval=maxval) (in the same jit).
    With `rows` (int [k]) only those indices of the first axis are drawn: == uniform(...)[rows].
    `once`: the draw is read by several fusions (a stochastic mask): on CPU compute it once
    (below). Elsewhere that costs a pass, so a draw read once (a toy batch's) leaves it off."""
    n = math.prod(shape)
    if not _is_threefry(key) or n >= 2**32 - 1:
        out = jax.random.uniform(key, shape, minval=minval, maxval=maxval)
        return out if rows is None else out[rows]
    out_shape = shape if rows is None else (rows.shape[0], *shape[1:])
    # (with `rows` on a 1-D draw the pairs would straddle the picked elements: not paired)
    paired = once and tracing.platform() == "cpu" and len(shape) > (0 if rows is None else 1)
    view = (*out_shape[:-1], -(-shape[-1] // 2), 2) if paired else out_shape
    k1, k2 = jax.random.key_data(key)
    x0, x1 = _threefry2x32(k1, k2, jnp.zeros(view, jnp.uint32), _flat_index(shape, view, rows))
    mantissa = ((x0 ^ x1) >> np.uint32(9)) | np.uint32(0x3F800000)  # [1, 2) as float32 bits
    unit = jax.lax.bitcast_convert_type(mantissa, jnp.float32) - 1.0
    lo, hi = jnp.float32(minval), jnp.float32(maxval)
    out = jnp.maximum(0.0, unit) if (minval, maxval) == (0.0, 1.0) else jnp.maximum(
        lo, unit * (hi - lo) + lo)
    if not paired:
        return out
    # Computed once: XLA:CPU copies an elementwise producer into every consumer fusion (and
    # drops optimization_barrier before fusing), so a stochastic mask read by the forward, the
    # backward and the delta channel was hashed again in each, up to twice per element. A
    # dot's output is never copied; over pairs (a 1-wide dot becomes a multiply) with the
    # identity it is exact (x·1 + 0). Hashing in the pair layout keeps the index math free of
    # divisions; the leading axes, hence any sharding, stay as they are.
    out = jnp.matmul(out, jnp.eye(2, dtype=out.dtype), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(*out_shape[:-1], 2 * view[-2])[..., :shape[-1]]


def _flat_index(shape, view, rows=None):
    """uint32 [*view]: each element's row-major flat index in `shape` (threefry's counter);
    `view` is `shape` or its last axis as [ceil(d / 2), 2] pairs (with d odd, a row's padded
    tail element gets the next row's first index: hashed, then dropped), its first axis
    `rows` (the indices it holds) when given."""
    if not shape:
        return jnp.zeros((), jnp.uint32)

    def iota(ax):
        if ax == 0 and rows is not None:
            return jnp.broadcast_to(rows.astype(jnp.uint32).reshape(-1, *[1] * (len(view) - 1)),
                                    view)
        return jax.lax.broadcasted_iota(jnp.uint32, view, ax)

    if len(view) > len(shape):  # pairs: index along the last axis = 2 * pair + slot
        idx = iota(len(view) - 2) * np.uint32(2) + iota(len(view) - 1)
    else:
        idx = iota(len(shape) - 1)
    stride = 1
    for ax in range(len(shape) - 1, 0, -1):
        stride *= shape[ax]
        idx = idx + iota(ax - 1) * np.uint32(stride)
    return idx
