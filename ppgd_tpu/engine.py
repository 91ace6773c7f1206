"""The training loop: init, faithfulness warmup, steps, log/eval cadences, final summary.

Reads top to bottom like SPEC 6: build the frozen target, init the state, warm up, then
for each global step s train on data batch s // k [W1]. The loop waits for the device only
at log, eval and checkpoint steps, at the end of a profile window and, with several
processes, to keep at most MAX_IN_FLIGHT steps in flight.
"""

from __future__ import annotations

import collections
import math
import posixpath
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from ppgd_tpu import checkpoint, dist, resume, signals, storage
from ppgd_tpu import config as config_lib
from ppgd_tpu import mesh as mesh_lib
from ppgd_tpu import eval as eval_lib
from ppgd_tpu import metrics as metrics_lib
from ppgd_tpu.config import Config, ConfigError, config_hash
from ppgd_tpu.consumer import save_decomposition
from ppgd_tpu.data import lm as data_lib
from ppgd_tpu.decomp.components import resolve_sites, resolve_ties
from ppgd_tpu.programs import Batches, Programs, run_templates
from ppgd_tpu.replay import ReplayController, window_template
from ppgd_tpu.step import TrainState
from ppgd_tpu.targets import build as target_build
from ppgd_tpu.trace import StepTrace
from ppgd_tpu.wandb_sink import WandbSink
from ppgd_tpu.workspace import (CONFIG, DECOMPOSITION, EVALS, FIGURES, SUMMARY, RunDir,
                                write_summary)


MAX_IN_FLIGHT = 8  # multi-process CPU: steps dispatched ahead of the last finished one


DIVERGED = ("the decomposition diverged. Runs are deterministic, so resuming would repeat it: "
            "start a new --run_dir with a lower decomp.lr_components / decomp.lr_ci_fn or "
            "smaller loss coefficients.")


def check_finite(step: int, values: dict, prefixes: tuple[str, ...]) -> None:
    metrics_lib.check_finite(step, values, prefixes, DIVERGED)


@jax.jit
def _decomposition_finite(state: TrainState) -> jax.Array:
    return jnp.all(jnp.stack([jnp.isfinite(x).all()
                              for x in jax.tree.leaves((state.components, state.ci_fn))]))


def check_decomposition_finite(step: int, state: TrainState) -> None:
    """Before a save: a loss logged finite came before its step's update, so without this a
    checkpoint between log steps could commit nan components for a resume (or a
    load_decomposition) to read."""
    if not bool(_decomposition_finite(state)):
        raise metrics_lib.Diverged(f"step {step}: the components or the CI fn have "
                                   f"non-finite values; {DIVERGED}")


# Steps of the faithfulness warmup per dispatch: a stop is seen between two dispatches, so a
# dispatch must be short; few enough dispatches not to cost.
WARMUP_PART = 1000


class Trainer:
    """Everything a run needs, jitted once on the run's mesh: the step, the data, the evals."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        # Site patterns and the mesh are checked before any compute [D3].
        shapes = target_build.site_shapes(cfg.target)
        resolve_ties(cfg.decomp.tie, resolve_sites(cfg.decomp.sites, tuple(shapes)), shapes)
        self.mesh = mesh_lib.make_mesh(cfg.mesh)
        mesh_lib.check_batches(cfg, self.mesh)
        target = target_build.build(cfg.target)
        self.target_sha256 = target_build.fingerprint(target, cfg.target)
        by_process = dist.gather_from_all(self.target_sha256)
        if len(set(by_process)) > 1:  # e.g. each host read its own copy of target.path
            raise ConfigError("target: the processes built different weights (sha256 by "
                              "process: " + ", ".join(f"{i}: {h[:16]}..." for i, h in
                                                      enumerate(by_process))
                              + "); give every process the same target file")
        self.placement = mesh_lib.Placement(cfg, self.mesh, len(target.leading_shape((1, 1))))
        # Toys: batches drawn from (seed, j); LMs: token-store rows [B, T] (data/lm.py). Both
        # land row-sharded on the mesh, each process producing only its own rows.
        self.data = data_lib.make(cfg, target, lambda shape: self.placement.sharding(
            "batch", shape, target.input_axes))
        self.batch = self.data.batch
        store = getattr(self.data, "store", None)  # LMs: which tokenize run wrote it
        self.store_id = store.store_id if store is not None else None
        by_process = dist.gather_from_all(self.store_id)
        if len(set(by_process)) > 1:  # each host opened its own data.store
            raise ConfigError("data.store: the processes opened different token stores "
                              f"(store id by process: {by_process}); give every process "
                              "the same store")
        self.eval_batch, self.eval_labels = self.data.eval_batch, self.data.eval_labels
        struct = lambda x: None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)
        batches = Batches(jax.ShapeDtypeStruct(self.data.batch_shape, self.eval_batch.dtype),
                          struct(self.eval_batch), struct(self.eval_labels))
        self.programs = Programs(cfg, self.placement, target, batches)
        self.dec, self.shardings = self.programs.dec, self.programs.shardings
        self.target = mesh_lib.place(target, self.shardings.target)
        self.replay = self.programs.replay

    def init_state(self, stop: dist.StopSignal | None = None) -> TrainState | None:
        """[R1] placed init: the state is created sharded, equal to an unplaced init; then
        the faithfulness warmup [S21], in parts of WARMUP_PART steps. With `stop`, each part
        is waited for and then asked whether to stop (once if there is no warmup): None if
        so, the warmup's work discarded [C5]."""
        p = self.programs
        state = p.init(self.target)
        n = self.cfg.decomp.faithfulness_warmup_steps
        opt_state = p.warmup_optimizer_state(state) if n else None
        done = 0
        while True:
            if done < n:
                count = min(WARMUP_PART, n - done)
                state, opt_state = p.warmup_part(state, opt_state, self.target,
                                                 np.int32(count))
                done += count
            if stop is not None:
                # Dispatch is asynchronous: wait, so that a signal while the part computes
                # is seen here, as during warmup, and not after step 1 [C5].
                jax.block_until_ready(state)
                if stop.should_stop(-1):
                    return None
            if done == n:
                return state

    def to_host(self, tree):
        """Numpy copy of a (possibly cross-process sharded) tree, in every process."""
        return jax.device_get(self.programs.gather(tree))

    def restore(self, run_dir: str, step: int):
        """Checkpoint leaves placed on THIS run's mesh, whatever mesh wrote them [C4]."""
        infos = checkpoint.committed_manifest(run_dir, step).leaves
        batch = self.programs.batches.train
        named, _ = run_templates(self.dec, self.target, batch,
                                 window_template(self.dec, self.target, batch), metrics=False)
        try:
            shardings = self.placement.names(mesh_lib.by_name(named, infos))
        except mesh_lib.MeshError as e:  # a leaf no state of this code has
            raise checkpoint.damaged(run_dir, step, e) from None
        return checkpoint.restore(run_dir, step, shardings=shardings)

    def evaluate(self, state: TrainState, step: int) -> dict:
        fast, alive = self.programs.fast_eval(state, self.target, self.eval_batch,
                                             self.eval_labels)
        onehot = self.programs.one_hot(state, self.target) if self.target.n_features else None
        fast, alive, onehot = jax.device_get((fast, alive, onehot))
        out = metrics_lib.to_host(fast)
        check_finite(step, out, ("eval/recon/", "eval/ce/", "eval/kl/", "eval/faithfulness"))
        out.update(eval_lib.host_metrics(self.dec, self.to_host(state), self.to_host(self.target),
                                         onehot,
                                         {s: np.asarray(a) for s, a in alive.items()}))
        return out


def _check_one_config(cfg: Config) -> None:
    """Every process must run the same config: one given another (a stale --config file on
    one host) would train its shards on other rules, silently. Refused in every process,
    naming the fields (the first few). The target's and the store's paths may differ (a
    copy on each host): their contents are compared once read (target sha256, store id)."""
    mine = {path: repr(value) for path, _, value, _ in config_lib.leaves(cfg)
            if path not in ("target.path", "data.store")}
    every = dist.gather_from_all(mine)
    for index, other in enumerate(every[1:], 1):
        differ = [f"  {p}: {every[0].get(p)} in process 0, {other.get(p)} in process {index}"
                  for p in sorted(set(every[0]) | set(other)) if every[0].get(p) != other.get(p)]
        if differ:
            raise ConfigError(
                "the processes of this job were given different configs; every process "
                "must get the same --config and flags:\n" + "\n".join(differ[:10])
                + (f"\n  ... {len(differ)} fields in all" if len(differ) > 10 else ""))


def train(cfg: Config, run_dir: str) -> dict:
    """Runs, resumes, or reports already complete the decomposition of `cfg` in `run_dir`."""
    _check_one_config(cfg)
    # the dir's lock (local dirs) is taken by check_compatible (a resume) or create (a new
    # run), before anything is written, and held until the run returns
    with RunDir(run_dir) as rd:
        # Decided once, by the main process for all: each one asking itself could see the
        # config.yaml that process 0 writes in create() and skip create()'s collective.
        resuming = dist.broadcast_from_main(rd.exists)
        if resuming:
            rd.check_compatible(cfg)
            if rd.complete:
                summary = rd.read_summary()
                print(f"{run_dir}: already complete (summary.json exists); nothing to do.")
                return summary
        else:
            rd.check_creatable()
        trainer = Trainer(cfg)  # builds / validates the target before the run dir is touched
        if resuming:
            rd.check_inputs(cfg, trainer.target_sha256, trainer.store_id)
        else:
            rd.create(cfg, trainer.target_sha256, trainer.store_id)
        rd.drop_torn_writes()
        dist.barrier("run_dir_ready")
        logging.info("run dir %s", rd.path)
        saver = checkpoint.Checkpointer(
            rd.path, keep_last_n=cfg.checkpoint.keep_last_n,
            keep_every=cfg.checkpoint.keep_every or None, config_hash=config_hash(cfg),
            barrier=dist.barrier if jax.process_count() > 1 else None)
        with dist.StopSignal() as stop, saver, WandbSink(cfg, rd.path, dist.is_main()) as sink:
            try:
                summary = _run(cfg, rd, trainer, saver, stop, sink)
            except metrics_lib.Diverged as e:  # said with the run it ended
                raise metrics_lib.Diverged(f"{rd.path}: {e}") from None
            signals.finished()  # before the StopSignal hands the signals back
            return summary


def _run(cfg: Config, rd: RunDir, trainer: Trainer, saver, stop, sink: WandbSink) -> dict:
    steps, k = cfg.decomp.steps, cfg.data.train_batch_replay
    replay = trainer.replay
    start = checkpoint.latest_step(rd.path)
    window = []  # metrics of the steps since the last log (for their statistics)
    if start is None:  # a fresh run: init, then the faithfulness warmup [S21]
        began = time.perf_counter()
        start, state = 0, trainer.init_state(stop)
        if state is None:
            print(f"stopped ({stop.reason}) during faithfulness warmup; nothing was saved. "
                  "Re-run the same command to start over.")
            return {}
        if cfg.decomp.faithfulness_warmup_steps:
            logging.info("init and faithfulness warmup (%d steps): %.1f s",
                         cfg.decomp.faithfulness_warmup_steps, time.perf_counter() - began)
    else:  # [C3] resume: no warmup; the window continues on batch start // k [W6]
        restored = trainer.restore(rd.path, start)
        try:
            state = resume.restore_state(trainer.dec, trainer.target, restored.arrays)
            if start % k:
                resume.restore_window(replay, trainer.dec, state, trainer.target,
                                      trainer.batch(start // k), restored.arrays)
            window = resume.log_window(restored.manifest)
        except checkpoint.DamagedCheckpoint as e:  # leaves or meta this run's state lacks
            raise checkpoint.damaged(rd.path, start, e) from None
        logging.info("resumed from the checkpoint at step %d", start)
    if start >= steps:
        return _finish(cfg, rd, trainer, state, stop, sink)

    writer = metrics_lib.MetricsWriter(rd.path, enabled=dist.is_main(),
                                       tensorboard=cfg.log.tensorboard, resume_step=start,
                                       also=sink)
    progress = metrics_lib.Progress(steps, start, cfg.log.progress and dist.is_main())
    clock, s_last = metrics_lib.WindowClock(), start

    def save(step, state):
        check_decomposition_finite(step, state)
        writer.flush()  # on gs:// every metrics line up to a committed step is stored first
        saver.save(step, resume.checkpoint_leaves(state, replay),
                   meta={"log_window": metrics_lib.window_carry(window)})

    in_flight = collections.deque()
    trace = StepTrace(rd.path, cfg.log.profile_start, cfg.log.profile_steps, start,
                      say=progress.say)
    try:
        with trace:
            for s in range(start, steps):
                trace.before(s)
                batch = trainer.batch(s // k)
                state, m = replay.step(s, state, trainer.target, batch)
                trace.after(s + 1, state)
                window.append(m)
                done = s + 1
                if jax.process_count() > 1:  # bound the steps in flight (gloo deadlocks past ~16)
                    in_flight.append(m["train/loss/total"])
                    if len(in_flight) > MAX_IN_FLIGHT:
                        in_flight.popleft().block_until_ready()
                if done % cfg.log.every == 0 or done == steps:
                    values = _log_record(window, s, replay, clock, done - s_last,
                                         batch.shape, trainer.target)
                    progress.update(done - s_last, values["train/loss/total"])
                    s_last, window = done, []
                    writer.write(done, values)
                    check_finite(done, values, ("train/loss/",))
                if cfg.eval.every and done % cfg.eval.every == 0 and done != steps:
                    with clock.aside(state):
                        writer.write(done, trainer.evaluate(state, done))
                saved = False
                if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done != steps:
                    with clock.aside(state):
                        save(done, state)
                    saved = True
                if done != steps and stop.should_stop(done):  # [C5] every process, the same step
                    if not saved:
                        save(done, state)
                    saver.wait()
                    dist.barrier(f"stopped_{done}")
                    progress.close()
                    writer.close()
                    print(f"stopped at step {done} ({stop.reason}); checkpoint committed in "
                          f"{rd.path}/ckpts/{done}. Resume with the same command and "
                          f"--run_dir={rd.path}.")
                    return {}
    except BaseException as e:
        progress.close()  # its line ends before the error's
        if isinstance(e, metrics_lib.Diverged):  # the metrics so far (the bad line) stay
            writer.close()
        raise
    progress.close()
    save(steps, state)
    writer.close()
    saver.wait()
    return _finish(cfg, rd, trainer, state, stop, sink)


def _log_record(window: list[dict], s: int, replay: ReplayController,
                clock: metrics_lib.WindowClock, n_steps: int, batch_shape: tuple[int, ...],
                target) -> dict:
    """The metrics.jsonl line of log step s + 1: the last step's metrics, the statistics
    of the window of `n_steps` steps since the last log, where s sits in its replay window,
    and the window's timing and throughput. The clock is read once the window's metrics
    are fetched, i.e. once the device has run its steps."""
    window = [metrics_lib.to_host(w) for w in jax.device_get(window)]
    values = dict(window[-1])
    values.update(metrics_lib.window_stats(window))
    values["train/replay/window_position"] = s % replay.k
    values["train/replay/ci_updated"] = int(replay.ci_updated(s))
    values.update(clock.take(n_steps))
    values.update(_throughput(values["train/perf/step_time_s"], batch_shape, target))
    return values


def _throughput(step_s: float, batch_shape: tuple[int, ...], target) -> dict:
    """The global batch's rows (and, for a sequence target, tokens) per second of step
    time, as MaxText and levanter report them."""
    out = {}
    if step_s > 0:
        out["train/perf/examples_per_s"] = batch_shape[0] / step_s
        if target.n_features is None:  # [B, T] tokens
            out["train/perf/tokens_per_s"] = math.prod(batch_shape) / step_s
    return out


def _finish(cfg: Config, rd: RunDir, trainer: Trainer, state: TrainState,
            stop: dist.StopSignal, sink: WandbSink) -> dict:
    """Final eval, decomposition file, figures, then summary.json LAST (WORKSPACE.md);
    the final line, the figures and the summary go to W&B too (`sink`).

    The final checkpoint is committed, so a signal from here on ends the command at once
    (re-run, it redoes only this): the StopSignal, which only notes signals for a step
    boundary, hands them back, and one it noted since the loop's last boundary (or on a
    resume that had no step left) is delivered now [C5]: a long final eval stops on Ctrl-C."""
    stop.close()
    for name in stop.signals_received[:1]:
        signal.raise_signal(signal.Signals[name])
    figures = rd.file(FIGURES) if cfg.eval.figures else None
    summary, state = _evaluate(trainer, state, cfg.decomp.steps, figures,
                               f"{cfg.name} ({rd.path}), step {cfg.decomp.steps}")
    if dist.is_main():
        writer = metrics_lib.MetricsWriter(rd.path, enabled=True, tensorboard=False, also=sink)
        writer.write_final(cfg.decomp.steps, summary)
        writer.close()  # on gs:// the line is held in memory until then
        if figures is not None:
            sink.images(cfg.decomp.steps, figures)
        sink.summary(summary)
        save_decomposition(rd.file(DECOMPOSITION), state, trainer.dec.sites)
        summary = {"step": cfg.decomp.steps, **summary}
        write_summary(rd.file(SUMMARY), summary)
        _print_summary(summary)
    return summary


def _evaluate(trainer: Trainer, state: TrainState, step: int, figures: str | None,
              title: str) -> tuple[dict, TrainState]:
    """The fast tier, then (main process) the figures into `figures` (None: none) ->
    (eval metrics, the state on the host)."""
    summary = trainer.evaluate(state, step)
    # collectives: every process fetches, since the arrays may span processes
    state, target, eval_batch = trainer.to_host((state, trainer.target, trainer.eval_batch))
    if dist.is_main() and figures is not None:
        eval_lib.figures(trainer.dec, state, target, eval_batch, figures, title)
    return summary, state


def _print_summary(summary: dict) -> None:
    print(metrics_lib.table({k: v for k, v in summary.items() if k != "step"}))
    note = eval_lib.recovery_note(summary)
    if note:
        print(note)


def _eval_output(rd: RunDir, output: str | None, step: int) -> str:
    """Where `ppgd-tpu eval` writes: RUN_DIR/evals/step_<step>, or `output` when that is in
    no run dir (a run's own config.yaml, summary.json and figures/ must not be replaced)."""
    evals = storage.join(rd.path, EVALS)
    try:
        out = storage.normalize(output or storage.join(evals, f"step_{step}"))
        storage.check_creatable(out, directory=True)
    except ValueError as e:
        raise ConfigError(f"--output: {e}") from None
    if out == evals or out.startswith(evals + "/"):
        return out
    here = out
    while here and not here.endswith(":"):  # `out` and the dirs above it (gs://: its bucket)
        if storage.exists(storage.join(here, CONFIG)):
            where = "is a run dir" if here == out else f"is inside the run dir {here}"
            raise ConfigError(
                f"--output: {out} {where}; eval writes config.yaml, summary.json and "
                "figures/, which would replace or mix with a run's own: give a dir outside "
                "any run dir, or leave --output out (RUN_DIR/evals/step_<step>)")
        here = "" if posixpath.dirname(here) == here else posixpath.dirname(here)
    return out


def committed_step(rd: RunDir, step: int | None) -> int:
    """`step` (None: the latest), checked to be a committed checkpoint of the run in `rd`
    (ConfigError naming --run_dir or --step otherwise). Listed once, by the main process for
    all: a run still training commits (and retention deletes) steps between two processes'
    listings, and each restoring the newest step it saw would read a state mixed from two
    checkpoints."""
    committed = dist.broadcast_from_main(checkpoint.committed_steps(rd.path))
    if not committed:
        raise ConfigError(f"--run_dir: {rd.path} has no committed checkpoint yet (a run "
                          "commits one on checkpoint.every, on a stop signal and at its end)")
    step = committed[-1] if step is None else step
    if step not in committed:
        raise ConfigError(f"--step: {step} is not a committed checkpoint of {rd.path}; "
                          f"its committed steps: {', '.join(map(str, committed))}")
    return step


def restore_committed(cfg: Config, rd: RunDir, step: int) -> tuple[Trainer, TrainState]:
    """The run's programs on this mesh (a Trainer under `cfg`) and its state at the committed
    checkpoint `step` (committed_step), placed on that mesh; reads the run's files only. The
    target must be the weights the run started with; a checkpoint that the running run's
    retention deletes while it is read is a ConfigError naming --step."""
    trainer = Trainer(cfg)
    rd.check_inputs(cfg, trainer.target_sha256, None)  # the run's weights; any store
    try:
        restored = trainer.restore(rd.path, step)
    except (FileNotFoundError, checkpoint.DamagedCheckpoint):
        if step in checkpoint.committed_steps(rd.path):
            raise
        raise ConfigError(f"--step: checkpoint {step} of {rd.path} was deleted while it was "
                          "read (the running run's retention, checkpoint.keep_last_n; "
                          "checkpoint.keep_every keeps some for good): use a newer "
                          "one") from None
    try:
        state = resume.restore_state(trainer.dec, trainer.target, restored.arrays)
    except checkpoint.DamagedCheckpoint as e:
        raise checkpoint.damaged(rd.path, step, e) from None
    return trainer, state


def evaluate_checkpoint(cfg: Config, rd: RunDir, step: int | None, output: str | None) -> dict:
    """`ppgd-tpu eval`: the fast tier and the figures of the committed checkpoint `step`
    (None: the latest) of the run in `rd`, under `cfg` (its config, eval fields changed),
    into `output` (None: RUN_DIR/evals/step_<step>): config.yaml, figures/, then
    summary.json. It only reads the run's files and takes no lock, so a run that is still
    training can be evaluated; the run never touches evals/."""
    _check_one_config(cfg)
    step = committed_step(rd, step)
    out = _eval_output(rd, output, step)
    trainer, state = restore_committed(cfg, rd, step)
    figures = storage.join(out, FIGURES) if cfg.eval.figures else None
    summary, _ = _evaluate(trainer, state, step, figures, f"{cfg.name} ({rd.path}), step "
                           f"{step}, ppgd-tpu eval")
    summary = {"step": step, **summary}
    if dist.is_main():
        storage.write_bytes(storage.join(out, CONFIG), config_lib.dump_yaml(cfg).encode())
        write_summary(storage.join(out, SUMMARY), summary)
        _print_summary(summary)
        print(f"evaluated step {step} of {rd.path}: {out}/summary.json"
              + (f", {figures}/" if figures else ""))
    return summary
