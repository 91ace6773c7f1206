"""The report's one pass over data: CI statistics of every component over N rows, jitted
and sharded on the run's mesh like `ppgd-tpu eval`.

Rows: an LM's first N rows of its token store, which are the held-out rows when
`data.eval_rows` >= N (those its pretraining and its decomposition never trained on); a
toy's N rows drawn from its own data distribution under a key of their own (REPORT_TAG),
never a training batch. They are scanned in chunks of `eval.batch_size` rows (a size the
mesh's batch shards divide [D3]), the last one padded and its padding masked out; an LM's
chunk is read by each process for its own devices only (`mesh.global_batch`), a toy's is
drawn sharded inside jit.

Per site and component c, summed over the chunks on the device (ScanStats):
  count[c]     positions (every leading index) with CI lower > eval.ci_alive_threshold
  total[c]     the sum of CI lower
  hist[c, b]   positions with CI lower in bin b of HIST_BINS equal bins of [0, 1]
  coact[c, d]  positions where c and d are both above the threshold (within the site)
and, for a sequence target, the TOP_K positions of highest CI of each component with the
CI of that component and the token ids on a window of CONTEXT_BEFORE tokens before and
CONTEXT_AFTER after (outside the row: token -1, CI 0); ties keep the earlier position.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ppgd_tpu import dist, tracing
from ppgd_tpu import mesh as mesh_lib
from ppgd_tpu.config import ConfigError

HIST_BINS = 20
CONTEXT_BEFORE, CONTEXT_AFTER = 12, 4
WINDOW = CONTEXT_BEFORE + 1 + CONTEXT_AFTER
REPORT_TAG = 0x4E90  # fold_in index of a toy report's rows (DATA_TAG and EVAL_TAG are others)


class SiteStats(NamedTuple):
    """A site's sums over the scanned positions (module docstring). The top_* fields are
    None for a position-less (toy) target; top_row counts from the first scanned row."""

    count: jax.Array  # [C] int32
    total: jax.Array  # [C] float32
    hist: jax.Array  # [C, HIST_BINS] int32
    coact: jax.Array  # [C, C] int32
    top_ci: jax.Array | None  # [C, K] float32, descending; -inf where no position was seen
    top_row: jax.Array | None  # [C, K] int32
    top_pos: jax.Array | None  # [C, K] int32
    window_ci: jax.Array | None  # [C, K, WINDOW] float32
    window_tokens: jax.Array | None  # [C, K, WINDOW] int32


class Scan(NamedTuple):
    """What `scan` found: per-site host statistics, the number of rows and of positions
    they hold, and (LMs) the store row ids of the scanned rows, in scan order."""

    stats: dict[str, SiteStats]
    n_rows: int
    n_positions: int
    row_ids: np.ndarray | None


def _empty(C: int, top_k: int | None) -> SiteStats:
    top = None if top_k is None else (
        jnp.full((C, top_k), -jnp.inf, jnp.float32), jnp.zeros((C, top_k), jnp.int32),
        jnp.zeros((C, top_k), jnp.int32), jnp.zeros((C, top_k, WINDOW), jnp.float32),
        jnp.full((C, top_k, WINDOW), -1, jnp.int32))
    return SiteStats(jnp.zeros((C,), jnp.int32), jnp.zeros((C,), jnp.float32),
                     jnp.zeros((C, HIST_BINS), jnp.int32), jnp.zeros((C, C), jnp.int32),
                     *(top or (None,) * 5))


def _top_contexts(acc: SiteStats, ci, tokens, valid, offset) -> tuple:
    """acc's top-K merged with this chunk's: ci [b, T, C], tokens [b, T], valid [b]."""
    b, T, C = ci.shape
    K = acc.top_ci.shape[1]
    scored = jnp.where(valid[:, None, None], ci, -1.0).transpose(2, 0, 1).reshape(C, b * T)
    value, flat = jax.lax.top_k(scored, K)  # [C, K]
    row, pos = flat // T, flat % T
    where = pos[..., None] + jnp.arange(-CONTEXT_BEFORE, CONTEXT_AFTER + 1)  # [C, K, W]
    inside = (where >= 0) & (where < T)
    at = jnp.clip(where, 0, T - 1)
    comp = jnp.arange(C)[:, None, None]
    w_ci = jnp.where(inside, ci[row[..., None], at, comp], 0.0)
    w_tok = jnp.where(inside, tokens[row[..., None], at], -1)
    # earlier chunks first: top_k keeps the lower index among equal values
    both = (jnp.concatenate([acc.top_ci, value], 1),
            jnp.concatenate([acc.top_row, row + offset], 1),
            jnp.concatenate([acc.top_pos, pos], 1),
            jnp.concatenate([acc.window_ci, w_ci], 1),
            jnp.concatenate([acc.window_tokens, w_tok], 1))
    value, pick = jax.lax.top_k(both[0], K)
    return (value, *(jnp.take_along_axis(x, pick.reshape(pick.shape + (1,) * (x.ndim - 2)),
                                         axis=1) for x in both[1:]))


def _accumulate(dec, threshold: float, acc: dict, state, target, x, offset, n_rows) -> dict:
    """acc + the statistics of one chunk of rows `x`, global rows offset.. of the scan;
    the rows from n_rows on are padding."""
    lower = dec.ci(state.ci_fn, state.components, target, x).lower
    valid = offset + jnp.arange(x.shape[0]) < n_rows
    out = {}
    for s in dec.sites:
        ci = lower[s].astype(jnp.float32)
        C = ci.shape[-1]
        ok = jnp.broadcast_to(valid.reshape(valid.shape + (1,) * (ci.ndim - 2)),
                              ci.shape[:-1]).reshape(-1)
        flat = ci.reshape(-1, C)
        active = (flat > threshold) & ok[:, None]
        a = acc[s]
        binned = jnp.clip(jnp.floor(flat * HIST_BINS).astype(jnp.int32), 0, HIST_BINS - 1)
        hist = a.hist.reshape(-1).at[(jnp.arange(C) * HIST_BINS + binned).reshape(-1)].add(
            jnp.broadcast_to(ok[:, None], flat.shape).reshape(-1).astype(jnp.int32))
        af = active.astype(jnp.float32)  # a chunk's counts are exact in fp32 (< 2^24)
        top = (a.top_ci, a.top_row, a.top_pos, a.window_ci, a.window_tokens)
        if a.top_ci is not None:
            top = _top_contexts(a, ci, x, valid, offset)
        out[s] = SiteStats(a.count + jnp.sum(active, 0, dtype=jnp.int32),
                           a.total + jnp.sum(jnp.where(ok[:, None], flat, 0.0), 0),
                           hist.reshape(C, HIST_BINS),
                           a.coact + (af.T @ af).astype(jnp.int32), *top)
    return out


def check_top_k(top_k: int, chunk_positions: int) -> None:
    """A chunk's top_k needs that many positions in it."""
    if top_k > chunk_positions:
        raise ConfigError(f"--top_k: {top_k} exceeds the {chunk_positions} positions of one "
                          f"scanned chunk (eval.batch_size rows); use at most {chunk_positions}")


def lm_row_count(rows: int | None, n_store_rows: int, eval_rows: int, default: int) -> int:
    """The LM rows to scan: `rows` (None: `default`, at most the held-out rows, or the
    store's when none are held out); more than the store has, or than are held out when
    some are, is refused naming --rows."""
    pool = eval_rows or n_store_rows
    if rows is None:
        return min(default, pool)
    if rows > pool:
        held = (f"the {eval_rows} held-out rows (data.eval_rows)" if eval_rows
                else f"the {n_store_rows} rows of the store")
        raise ConfigError(f"--rows: {rows} exceeds {held}; use 1 .. {pool}")
    return rows


def scan(trainer, state, n_rows: int, top_k: int, progress: bool) -> Scan:
    """The statistics of `n_rows` rows (module docstring) under `state` (placed on
    trainer's mesh); every process calls it, each computing its own rows; every process
    gets the whole result."""
    cfg, dec, placement = trainer.cfg, trainer.dec, trainer.placement
    b = cfg.eval.batch_size
    lm = trainer.target.n_features is None
    store = getattr(trainer.data, "store", None)
    if lm:
        T = trainer.data.seq_len
        check_top_k(top_k, b * T)
        row_ids = np.arange(n_rows)
        shape = (b, T)
    else:
        T, row_ids, shape = 1, None, (b, trainer.target.n_features)
    rows_sharding = placement.sharding("batch", shape, trainer.target.input_axes)
    rep = placement.replicated
    acc = {s: _empty(dec.C[s], top_k if lm else None) for s in dec.sites}
    acc = jax.device_put(acc, rep)
    threshold = cfg.eval.ci_alive_threshold
    step = jax.jit(
        tracing.traced_on(placement.mesh,
                          lambda a, st, t, x, o, n: _accumulate(dec, threshold, a, st, t, x, o, n)),
        in_shardings=(rep, trainer.shardings.state, trainer.shardings.target, rows_sharding,
                      rep, rep),
        out_shardings=rep, donate_argnums=(0,))
    if lm:
        def chunk(j):
            ids = row_ids[j * b:(j + 1) * b]
            ids = np.concatenate([ids, np.zeros(b - len(ids), ids.dtype)])  # padding: row 0
            return mesh_lib.global_batch(
                lambda lo, hi: store.read_rows(ids[lo:hi]).astype(np.int32)[:, :-1],
                shape, rows_sharding)
    else:
        sample = trainer.target.sample  # toy samplers read shapes only
        chunk = jax.jit(lambda j: sample(jax.random.fold_in(jax.random.fold_in(
            jax.random.key(cfg.seed), REPORT_TAG), j), b), out_shardings=rows_sharding)
    n_chunks = math.ceil(n_rows / b)
    bar = None
    if progress and dist.is_main():
        from tqdm import tqdm

        bar = tqdm(total=n_rows, unit="row", desc="report scan", mininterval=1.0)
    for j in range(n_chunks):
        acc = step(acc, state, trainer.target, chunk(j), np.int32(j * b), np.int32(n_rows))
        if bar is not None:
            jax.block_until_ready(acc)
            bar.update(min(b, n_rows - j * b))
    if bar is not None:
        bar.close()
    host = jax.device_get(acc)
    return Scan(host, n_rows, n_rows * T, row_ids)
