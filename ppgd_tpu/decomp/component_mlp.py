"""The per-component CI MLP's kernel (SPEC 3, the SPD paper's CI fn), shaped for XLA:CPU.

out_c = sum_h w2[c,h] gelu(a_c w1[c,h] + b1[c,h]) + b2[c] over rows of a [*lead, C]: a pure
elementwise-and-reduce over a hidden layer of h values per row and component, which XLA:CPU
runs poorly as written, so on CPU (what each choice measured: docs/performance-log.md):

- rows whose inputs are all exactly zero (a toy batch's rows with every feature off) all
  have the output f(0) and the input gradient g * f'(0), so only the live rows go through
  the MLP: gathered live-rows-first into fixed-size chunks and run by a `fori_loop` whose
  trip count is the number of chunks holding live rows (one compiled body, any live
  fraction). Exact: the same per-row arithmetic, the weight-gradient sums only reassociated;
- the forward sums over h unrolled, h terms of [rows, C] elementwise ops: one fused
  elementwise pass that never forms the hidden layer (the output reassociated, within 2e-7
  relative of a reduction over the layer). The backward keeps the layer (unrolled the same
  way it ran no faster);
- the backward recomputes the hidden layer chunk by chunk and accumulates the weight
  gradients, so the working set stays in cache;
- the backward's hidden layer is laid out [rows, h, C], so every sum (over h; over rows for
  the weight gradients) is over a non-minor axis, which XLA:CPU vectorises along C (laid out
  [rows, C, h] it reduces the minor h lane by lane; bit-identical results either way);
- narrow sites share one call (`site_mlps`), concatenated on C: each call pays for finding
  its live rows and for its chunk loop whatever its width; sites that fill a chunk on their
  own run alone.

Off CPU the whole batch goes through in one chunk: accelerators fuse the pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ppgd_tpu import tracing
from ppgd_tpu.decomp.live_rows import live_first

_GELU_K0, _GELU_K1 = float(np.sqrt(2.0 / np.pi)), 0.044715


def _gelu_and_slope(z):
    """tanh-GELU (jax.nn.gelu's default) and its derivative from one tanh."""
    t = jnp.tanh(_GELU_K0 * (z + _GELU_K1 * z * z * z))
    return 0.5 * z * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * _GELU_K0 * (
        1.0 + 3.0 * _GELU_K1 * z * z)


CHUNK_BYTES = 1 << 19  # per-chunk [rows, C, h] working set: fits a CPU core's L2


def chunk_rows(n_rows: int, width: int) -> int:
    """Rows per chunk: all of them off CPU (accelerators fuse the whole [rows, C, h] pass);
    on CPU as many as keep a chunk's [rows, C, h] fp32 working set under CHUNK_BYTES, a
    multiple of 8."""
    if tracing.platform() != "cpu":
        return n_rows
    return min(n_rows, max(8, CHUNK_BYTES // (4 * width) // 8 * 8))


def _live_chunks(a, k: int):
    """Row indices [n, k] of the rows of a [rows, C] that are not all zero, live rows first
    in row order, padded with `rows` (zero on gather, dropped on scatter); the number of
    chunks holding live rows; the live mask. With k = rows (off CPU) every row, in one chunk."""
    rows = a.shape[0]
    if k == rows:
        return jnp.arange(rows)[None], 1, jnp.ones((rows,), bool)
    live = jnp.any(a != 0, axis=-1)
    n = -(-rows // k)
    order, _, n_live = live_first(live)
    slot = jnp.arange(n * k)
    idx = jnp.where(slot < n_live, jnp.pad(order, (0, n * k - rows)), rows)
    return idx.reshape(n, k), (n_live + k - 1) // k, live


def _fwd(a, w1, b1, w2, b2):
    a = jnp.asarray(a)  # eager callers may pass host constants, which have no `.at`
    rows, C = a.shape
    k = chunk_rows(rows, C * w1.shape[-1])
    idx, n_live, live = _live_chunks(a, k)
    y0, _ = _gelu_and_slope(b1)  # the hidden layer of an all-zero row
    w1t, b1t, w2t = w1.T, b1.T, w2.T

    def chunk(i, out):
        ac = a.at[idx[i]].get(mode="fill", fill_value=0)
        y = b2
        for j in range(w1t.shape[0]):  # the sum over h unrolled: see the module docstring
            y = y + _gelu_and_slope(ac * w1t[j] + b1t[j])[0] * w2t[j]
        return out.at[idx[i]].set(y, mode="drop")

    out0 = jnp.broadcast_to(jnp.sum(y0 * w2, -1) + b2, a.shape).astype(a.dtype)
    out = jax.lax.fori_loop(0, n_live, chunk, out0)
    return out, (a, idx, n_live, live, w1, b1, w2)


def _bwd(res, g):
    """Live rows chunk by chunk; all-zero rows from the hidden layer at a = 0: their input
    gradient is g f'(0), their weight gradients those of one zero row under their summed g."""
    a, idx, n_live, live, w1, b1, w2 = res
    y0, s0 = _gelu_and_slope(b1)
    g0 = jnp.sum(jnp.where(live[:, None], jnp.zeros_like(g), g), 0)  # [C]
    w1t, b1t, w2t = w1.T, b1.T, w2.T

    def chunk(i, acc):
        dw1, db1, dw2, da = acc  # weight gradients [h, C]
        ac = a.at[idx[i]].get(mode="fill", fill_value=0)
        gc = g.at[idx[i]].get(mode="fill", fill_value=0)
        y, slope = _gelu_and_slope(ac[:, None] * w1t + b1t)  # [k, h, C]: the docstring
        dpre = gc[:, None] * w2t * slope
        return (dw1 + jnp.sum(dpre * ac[:, None], 0), db1 + jnp.sum(dpre, 0),
                dw2 + jnp.sum(y * gc[:, None], 0),
                da.at[idx[i]].set(jnp.sum(dpre * w1t, 1), mode="drop"))

    f32 = jnp.result_type(a, w1)
    da0 = (g * jnp.sum(w2 * s0 * w1, -1)).astype(f32)
    init = (jnp.zeros(w1.T.shape, f32), (g0[:, None] * w2 * s0).T.astype(f32),
            (y0 * g0[:, None]).T.astype(f32), da0)
    dw1, db1, dw2, da = jax.lax.fori_loop(0, n_live, chunk, init)
    return (da.astype(a.dtype), dw1.T.astype(w1.dtype), db1.T.astype(b1.dtype),
            dw2.T.astype(w2.dtype), jnp.sum(g, 0).astype(w2.dtype))


@jax.custom_vjp
def _rows_mlp(a, w1, b1, w2, b2):
    return _fwd(a, w1, b1, w2, b2)[0]


_rows_mlp.defvjp(_fwd, _bwd)


MERGE_WIDTH = 1024  # C * h of the sites that share a call: chunks of >= 128 rows


def site_mlps(acts: dict, w1: dict, b1: dict, w2: dict, b2: dict) -> dict:
    """`component_mlp` of every site ({site: [*lead, C_s]}, one leading shape): on CPU,
    consecutive sites whose summed C * h is at most MERGE_WIDTH go through ONE call,
    concatenated on C (the same per-row arithmetic; the weight-gradient sums reassociated)."""
    groups: list[list[str]] = []
    width = 0
    for s in acts:
        w = w1[s].size
        if groups and tracing.platform() == "cpu" and width + w <= MERGE_WIDTH:
            groups[-1].append(s)
            width += w
        else:
            groups.append([s])
            width = w
    out = {}
    for g in groups:
        cat = lambda d, axis: jnp.concatenate([d[s] for s in g], axis=axis)
        y = component_mlp(cat(acts, -1), cat(w1, 0), cat(b1, 0), cat(w2, 0), cat(b2, 0))
        ends = np.cumsum([acts[s].shape[-1] for s in g])[:-1]
        out.update(zip(g, jnp.split(y, ends, axis=-1)))
    return out


def component_mlp(a, w1, b1, w2, b2):
    """Per-component scalar MLP [*lead, C] -> [*lead, C] with weights [C, h] (b2 [C]):
    out_c = sum_h w2[c,h] gelu(a_c w1[c,h] + b1[c,h]) + b2[c]. The backward recomputes the
    hidden layer instead of keeping it."""
    C = a.shape[-1]
    return _rows_mlp(a.reshape(-1, C), w1, b1, w2, b2).reshape(a.shape)
