"""Token-store data of an LM decomposition run (toys: data/toy.py `ToyData`).

Both kinds offer `batch(j)` (data batch j, a pure function of (seed, j) [W1, C1]) and a
fixed `eval_batch`; an LM also offers `eval_labels` (the next tokens, for the CE metrics).

LM rows: a store row of `seq_len` tokens gives the inputs `row[:-1]` ([B, T], T = seq_len
- 1, as in LM pretraining) and the labels `row[1:]`. Training batch j is the global batch
j of a BatchSchedule keyed by (seed, j) over the rows after the held-out `data.eval_rows`;
each process reads only the rows its own devices hold under the run's row sharding
(`mesh.global_batch`) [D1, D3], so the batch is the same on any mesh. The eval batch is
batch 0 of a separate schedule (seed `data.eval_seed`) over the held-out rows (all rows
when eval_rows = 0).

Every check runs here, before any compute: a missing, incomplete or damaged store (a
garbled meta.json, a shard file cut short: data/tokens.py), ids past the target's
vocabulary, rows past its max_seq_len, a batch that does not divide over the processes,
too few rows; each is a ConfigError naming the field. A read that fails later (damage the
open could not see) is a ConfigError naming data.store and the shard file too.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from ppgd_tpu import mesh as mesh_lib
from ppgd_tpu.config import Config, ConfigError
from ppgd_tpu.data.schedule import BatchSchedule, train_eval_schedules
from ppgd_tpu.data.tokens import DamagedStoreError, IncompleteStoreError, TokenStore
from ppgd_tpu.data.toy import ToyData
from ppgd_tpu.targets import build, llama_simple_mlp

LM_KINDS = ToyData.LM_KINDS


def is_lm(cfg: Config) -> bool:
    return cfg.target.kind in LM_KINDS


RowSharding = Callable[[tuple[int, ...]], Sharding]  # batch shape -> its row sharding


def all_devices_rows(shape: tuple[int, ...]) -> Sharding:
    """Rows over every device in order (for use without a run's mesh)."""
    return NamedSharding(Mesh(np.asarray(jax.devices()), ("data",)), PartitionSpec("data"))


class LMData:
    """Rows of a token store as [B, T] int32 token batches on the row sharding `rows`."""

    def __init__(self, cfg: Config, rows: RowSharding | None = None):
        self.rows = rows or all_devices_rows
        d = cfg.data
        if not d.store:
            raise ConfigError(
                f"data.store: required when target.kind is {cfg.target.kind!r}: pass the "
                "token store made by `ppgd-tpu tokenize` (a local path or gs://bucket/prefix)")
        try:
            self.store = TokenStore.open(d.store)
        except IncompleteStoreError as e:
            raise ConfigError(f"data.store: {e}") from None
        llama_simple_mlp.check_tokens(cfg.target.llama_simple_mlp, self.store.vocab_size,
                                      self.store.seq_len - 1, f"the token store at {d.store}")
        if cfg.target.path:
            build.check_tokenizer(cfg.target.path, self.store.tokenizer_id,
                                  self.store.store_id, d.store)
        n, B, B_eval = self.store.n_rows, d.batch_size, cfg.eval.batch_size
        n_proc = jax.process_count()
        if B % n_proc:
            raise ConfigError(f"data.batch_size: {B} does not divide over {n_proc} processes; "
                              f"use a multiple of {n_proc}, or {mesh_lib.RESUME_COUNT}")
        if n_proc > 1 and B % jax.device_count():
            raise ConfigError(f"data.batch_size: {B} does not divide over "
                              f"{jax.device_count()} devices; use a multiple of it, or "
                              f"{mesh_lib.RESUME_COUNT} [D3]")
        if B > n:
            raise ConfigError(f"data.batch_size: {B} rows exceed the {n} rows of {d.store}; "
                              "lower it, or tokenize more text")
        if not d.eval_rows < n - B + 1:
            raise ConfigError(
                f"data.eval_rows: {d.eval_rows} held-out rows leave fewer than one batch "
                f"(data.batch_size {B}) of the {n} rows of {d.store}")
        pool = d.eval_rows or n
        if B_eval > pool:
            raise ConfigError(
                f"eval.batch_size: {B_eval} exceeds the {pool} rows eval draws from "
                f"({'data.eval_rows' if d.eval_rows else 'the store'}); lower it")
        self.train, held_out = train_eval_schedules(
            n, train_batch=B, train_seed=cfg.seed, eval_batch=B_eval,
            eval_seed=d.eval_seed, eval_rows=d.eval_rows)
        self.seq_len = self.store.seq_len - 1
        self.batch_shape = (B, self.seq_len)
        self.eval_batch = self._global(held_out, 0, inputs=True)
        self.eval_labels = self._global(held_out, 0, inputs=False)

    def _global(self, schedule: BatchSchedule, j: int, inputs: bool) -> jax.Array:
        """Global batch j of `schedule` (inputs row[:-1] or labels row[1:]); each process
        reads only the store rows its own devices hold [D1, D3]."""
        ids = schedule.rows(j)
        shape = (len(ids), self.seq_len)

        def fetch(start: int, stop: int) -> np.ndarray:
            try:
                rows = self.store.read_rows(ids[start:stop]).astype(np.int32)
            except DamagedStoreError as e:  # damage the size check at open could not see
                raise ConfigError(f"data.store: {e}") from None
            return rows[:, :-1] if inputs else rows[:, 1:]

        return mesh_lib.global_batch(fetch, shape, self.rows(shape))

    def batch(self, j: int) -> jax.Array:
        """Training inputs of data batch j: [B, T] int32 (row[:-1])."""
        return self._global(self.train, j, inputs=True)


def make(cfg: Config, target, rows: RowSharding | None = None):
    """The data of a run (validated before any compute), its batches on `rows`."""
    return LMData(cfg, rows) if is_lm(cfg) else ToyData(cfg, target, rows)


def batch_shape(cfg: Config, target) -> tuple[int, ...]:
    """The training batch for `ppgd-tpu shardings` and load_run (shapes only, no store
    opened): [B, n_features] toy inputs; [B, T] tokens with T = the target's max_seq_len
    (a run's T is its store's row length - 1)."""
    if target.n_features is not None:
        return (cfg.data.batch_size, target.n_features)
    return (cfg.data.batch_size, cfg.target.llama_simple_mlp.max_seq_len)


def batch_dtype(target):
    return jax.numpy.float32 if target.n_features is not None else jax.numpy.int32


def batch_structs(cfg: Config, target):
    """(training batch, eval batch, eval labels or None) as ShapeDtypeStructs, from the
    config alone (no store opened): what `ppgd-tpu compile` builds a run's programs for."""
    train = batch_shape(cfg, target)
    dtype = batch_dtype(target)
    eval_ = (cfg.eval.batch_size, *train[1:])
    labels = None if target.n_features is not None else jax.ShapeDtypeStruct(eval_, dtype)
    return (jax.ShapeDtypeStruct(train, dtype), jax.ShapeDtypeStruct(eval_, dtype), labels)
