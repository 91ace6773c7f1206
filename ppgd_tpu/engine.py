"""The training loop: init, faithfulness warmup, steps, log/eval cadences, final summary.

Reads top to bottom like SPEC 6: build the frozen target, init the state, warm up, then
for each global step s train on data batch s // k [W1]. The loop blocks on the device only
at log and eval steps (one device_get each).
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
from absl import logging
from safetensors.numpy import load_file, save_file

from ppgd_tpu import eval as eval_lib
from ppgd_tpu import metrics as metrics_lib
from ppgd_tpu.config import Config
from ppgd_tpu.data import lm as data_lib
from ppgd_tpu.decomp.components import resolve_sites
from ppgd_tpu.replay import ReplayController
from ppgd_tpu.step import Decomposer, TrainState
from ppgd_tpu.targets import build as target_build
from ppgd_tpu.workspace import DECOMPOSITION, FIGURES, RunDir


class Trainer:
    """Everything a run needs, jitted once: the step, the data, the evals."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        # Site patterns are checked against the target's sites before any compute.
        resolve_sites(cfg.decomp.sites, target_build.site_names(cfg.target))
        self.target = target_build.build(cfg.target)
        # Toys: batches generated from (seed, j); LMs: token-store rows [B, T] (data/lm.py).
        self.data = data_lib.make(cfg, self.target)
        self.batch = self.data.batch
        self.eval_batch, self.eval_labels = self.data.eval_batch, self.data.eval_labels
        self.dec = Decomposer(cfg, self.target, self.data.batch_shape)
        self.replay = ReplayController(self.dec)
        self.fast_eval = jax.jit(
            lambda st, t, x, y: eval_lib.fast_metrics(self.dec, st, t, x, y))
        self.one_hot = jax.jit(lambda st, t: eval_lib.one_hot_ci(self.dec, st, t))

    def init_state(self) -> TrainState:
        state = jax.jit(self.dec.init)(self.target)
        if self.cfg.decomp.faithfulness_warmup_steps > 0:
            state = jax.jit(self.dec.faithfulness_warmup)(state, self.target)
        return state

    def evaluate(self, state: TrainState) -> dict:
        fast, alive = self.fast_eval(state, self.target, self.eval_batch, self.eval_labels)
        onehot = self.one_hot(state, self.target) if self.target.n_features else None
        fast, alive, onehot = jax.device_get((fast, alive, onehot))
        out = metrics_lib.to_host(fast)
        out.update(eval_lib.host_metrics(self.dec, jax.device_get(state), self.target, onehot,
                                         {s: np.asarray(a) for s, a in alive.items()}))
        return out


def train(cfg: Config, run_dir: str) -> dict:
    """Runs (or reports already complete) the decomposition of `cfg` in `run_dir`."""
    rd = RunDir(run_dir)
    if rd.exists:
        rd.check_compatible(cfg)
        if rd.complete:
            print(f"{run_dir}: already complete (summary.json exists); nothing to do.")
            with open(rd.file("summary.json")) as fh:
                return json.load(fh)
    trainer = Trainer(cfg)  # builds / validates the target before the run dir is touched
    if not rd.exists:
        rd.create(cfg)
    logging.info("run dir %s", os.path.abspath(run_dir))

    state = trainer.init_state()
    start = 0
    writer = metrics_lib.MetricsWriter(run_dir, enabled=jax.process_index() == 0,
                                       tensorboard=cfg.log.tensorboard)
    writer.truncate_after(start)
    steps, k = cfg.decomp.steps, cfg.data.train_batch_replay
    progress = metrics_lib.Progress(steps, start, cfg.log.progress and jax.process_index() == 0)
    t_last, s_last = time.perf_counter(), start
    if start % k:
        trainer.replay.start_window(state, trainer.target, trainer.batch(start // k))
    window = []  # device metrics of the steps since the last log (window statistics)
    for s in range(start, steps):
        state, m = trainer.replay.step(s, state, trainer.target, trainer.batch(s // k))
        window.append(m)
        done = s + 1
        if done % cfg.log.every == 0 or done == steps:
            window = [metrics_lib.to_host(w) for w in jax.device_get(window)]
            values = dict(window[-1])
            values.update(metrics_lib.window_stats(window))
            values["train/replay/window_position"] = s % k
            values["train/replay/ci_updated"] = int(trainer.replay.ci_updated(s))
            now = time.perf_counter()
            values["train/perf/step_time_s"] = (now - t_last) / (done - s_last)
            t_last, s_last, window = now, done, []
            writer.write(done, values)
            progress.update(done - progress_pos(progress, start), values["train/loss/total"])
        if cfg.eval.every and done % cfg.eval.every == 0 and done != steps:
            writer.write(done, trainer.evaluate(state))
    progress.close()

    summary = trainer.evaluate(state)
    writer.write(steps, summary)
    writer.close()
    save_decomposition(rd.file(DECOMPOSITION), state, trainer.dec.sites)
    if cfg.eval.figures:
        eval_lib.figures(trainer.dec, state, trainer.target, trainer.eval_batch,
                         rd.file(FIGURES))
    summary = {"step": steps, **summary}
    rd.write_summary(summary)
    print(metrics_lib.table({k: v for k, v in summary.items() if k != "step"}))
    return summary


def progress_pos(progress: metrics_lib.Progress, start: int) -> int:
    return progress.bar.n if progress.bar is not None else start


def save_decomposition(path: str, state: TrainState, sites) -> None:
    comps = jax.device_get(state.components)
    tensors = {}
    for s in sites:
        tensors[f"{s}/V"] = np.asarray(comps.V[s])
        tensors[f"{s}/U"] = np.asarray(comps.U[s])
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={"sites": json.dumps(list(sites))})
    os.replace(tmp, path)


def load_decomposition(run_dir: str) -> dict[str, dict[str, np.ndarray]]:
    """The consumer API: final components as numpy, {site: {"V": [d_in, C], "U": [C, d_out]}}."""
    path = os.path.join(run_dir, DECOMPOSITION)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir}: no finished decomposition ({DECOMPOSITION} missing)")
    flat = load_file(path)
    out: dict[str, dict[str, np.ndarray]] = {}
    for name, arr in flat.items():
        site, part = name.rsplit("/", 1)
        out.setdefault(site, {})[part] = arr
    return out
