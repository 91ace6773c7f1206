"""Metric sinks: RUN_DIR/metrics.jsonl (one flat JSON object per log step), TensorBoard
event files in RUN_DIR/tb, and the console progress bar. Only process 0 writes.

Device scalars are fetched in one `device_get` at log steps only: the metrics never make
the loop wait for the device between log steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import struct
import sys
import threading
import time

import jax
import numpy as np

from ppgd_tpu import storage


def to_host(metrics: dict) -> dict:
    """One transfer for the whole dict; numpy scalars -> Python numbers."""
    fetched = jax.device_get(metrics)
    return {k: (v.item() if isinstance(v, np.ndarray | np.generic) else v)
            for k, v in fetched.items()}


METRICS = "metrics.jsonl"  # RUN_DIR/metrics.jsonl: a line per log step and per eval
TENSORBOARD = "tb"  # RUN_DIR/tb: the event files
WINDOW_PREFIX = "train/grad_norms/summary/"  # the keys of the log window's statistics


def window_stats(window: list[dict]) -> dict:
    """min/median/max over the steps since the last log of each WINDOW_PREFIX key; keys
    missing on some steps (e.g. CI grad norms on replayed steps) use the steps that have
    them."""
    keys = sorted({k for m in window for k in m if k.startswith(WINDOW_PREFIX)})
    out = {}
    for k in keys:
        vals = np.array([m[k] for m in window if k in m], dtype=np.float64)
        out[f"{k}/min"] = float(vals.min())
        out[f"{k}/median"] = float(np.median(vals))
        out[f"{k}/max"] = float(vals.max())
    return out


def window_carry(window: list[dict]) -> list[dict]:
    """What a checkpoint between log steps keeps of the log window (host values of its
    WINDOW_PREFIX keys), so the first log line after a resume has the uninterrupted run's
    statistics. One device fetch; a save syncs with the device anyway."""
    return [{k: v for k, v in to_host(m).items() if k.startswith(WINDOW_PREFIX)}
            for m in jax.device_get(window)]


class CompileClock:
    """Seconds JAX spent tracing, lowering and compiling since the last `take()`, from its
    monitoring events: `train/perf/step_time_s` leaves them out (a window that compiled a
    step variant or the eval would otherwise show the compile as step time), and
    `train/perf/compile_s` shows them, 0 once every variant is compiled."""

    _PREFIX = "/jax/core/compile/"
    _lock = threading.Lock()
    _seconds = 0.0
    _listening = False

    def __init__(self):
        cls = CompileClock
        with cls._lock:
            if not cls._listening:  # JAX keeps listeners for the process's life
                jax.monitoring.register_event_duration_secs_listener(cls._heard)
                cls._listening = True
        self.take()

    @classmethod
    def _heard(cls, event: str, seconds: float, **_) -> None:
        if event.startswith(cls._PREFIX):
            with cls._lock:
                cls._seconds += seconds

    def take(self) -> float:
        """The seconds since the last call (or since construction), and restart."""
        with CompileClock._lock:
            seconds, CompileClock._seconds = CompileClock._seconds, 0.0
        return seconds


class WindowClock:
    """A log window's wall time, split: compiles (`train/perf/compile_s`), evals and
    checkpoint saves (`train/perf/eval_and_save_s`, a compile inside them counted once, as
    a compile), and the steps: `train/perf/step_time_s` is the rest per step."""

    def __init__(self):
        self._compiles = CompileClock()
        self._start = time.perf_counter()
        self._compiled = self._aside = 0.0

    @contextlib.contextmanager
    def aside(self, state):
        """Times the work inside as not the steps'. It waits for `state` first: the steps
        still in flight (dispatch is asynchronous) are the steps' time. Evals and saves
        wait for them anyway."""
        jax.block_until_ready(state)
        self._compiled += self._compiles.take()
        began = time.perf_counter()
        try:
            yield
        finally:
            inside = self._compiles.take()
            self._compiled += inside
            self._aside += time.perf_counter() - began - inside

    def take(self, n_steps: int) -> dict:
        """The window's split since the last call, and restart."""
        now = time.perf_counter()
        compile_s = self._compiled + self._compiles.take()
        out = {"train/perf/compile_s": compile_s, "train/perf/eval_and_save_s": self._aside,
               "train/perf/step_time_s": (now - self._start - compile_s - self._aside) / n_steps}
        self._start, self._compiled, self._aside = now, 0.0, 0.0
        return out


def _record(line: str) -> dict | None:
    try:
        record = json.loads(line) if line.endswith("\n") else None
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def records(path: str, data: bytes) -> list[tuple[str, dict]]:
    """(line, record) for each line of metrics.jsonl's bytes `data`. The last line may be
    torn (a process killed mid-append) and is then dropped; any other line that is not one
    JSON object with an integer `step` was damaged or edited by hand: ValueError naming
    `path`, the line and the way out (nothing is dropped silently)."""
    lines = data.splitlines(keepends=True)
    out = []
    for number, raw in enumerate(lines, 1):
        try:
            line = raw.decode()
        except UnicodeDecodeError:
            line = ""
        record = _record(line)
        if record is not None:
            out.append((line, record))
        elif number < len(lines):
            raise ValueError(
                f"{path}: line {number} is not a metrics record ({raw[:80]!r}); this package "
                "writes one JSON object with a `step` per line. Restore the file, or delete "
                "that line (or the file: it only holds what was logged) to resume")
    return out


class Diverged(RuntimeError):
    """A logged loss or eval value went non-finite: every later step would be too, so the
    run stops there, what it wrote so far (the bad line included) kept."""


def check_finite(step: int, values: dict, prefixes: tuple[str, ...], remedy: str) -> None:
    bad = {k: v for k, v in values.items() if k.startswith(prefixes) and not math.isfinite(v)}
    if bad:
        raise Diverged(f"step {step}: {', '.join(f'{k} = {v}' for k, v in sorted(bad.items()))}"
                       f"; {remedy}")


def json_values(values: dict) -> dict:
    """nan / inf as null: JSON has no such numbers (Python writes bare `NaN` tokens, which
    jq and strict parsers refuse); a diverged run names the values when it stops."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in values.items()}


def json_line(values: dict) -> str:
    """One metrics.jsonl record, strict JSON."""
    return json.dumps(json_values(values), allow_nan=False) + "\n"


class MetricsWriter:
    """RUN_DIR/metrics.jsonl, plus TensorBoard events (RUN_DIR/tb).

    Local files are appended line by line. A GCS object cannot be appended to, so on gs://
    the lines are kept here and the whole (small) file is rewritten at most every `flush_s`
    seconds and on close."""

    def __init__(self, run_dir: str, enabled: bool, tensorboard: bool,
                 resume_step: int | None = None, flush_s: float = 30.0, also=None):
        """With `resume_step`, what was logged after it is dropped (the resumed run logs
        those steps again): metrics.jsonl's lines now, TensorBoard's events by a purge from
        `resume_step + 1` (a SessionLog START, which TensorBoard honours when it reads).
        `also` (e.g. a wandb_sink.WandbSink): another sink, given each record by
        `.log(step, values)` once it is in metrics.jsonl."""
        self.enabled, self.also = enabled, also
        self.path = storage.join(run_dir, METRICS)
        self.remote = storage.is_gcs(run_dir)
        self.flush_s, self.flushed_at = flush_s, time.monotonic()
        self.lines: list[str] = []
        if enabled and self.remote and storage.exists(self.path):
            self.lines = [ln for ln, _ in records(self.path, storage.read_bytes(self.path))]
        if resume_step is not None:
            self._keep(lambda record: record["step"] <= resume_step)
        self.tb = None
        if enabled and tensorboard:
            self.tb = TensorBoard(storage.join(run_dir, TENSORBOARD),
                                  None if resume_step is None else resume_step + 1)

    def write_final(self, step: int, values: dict) -> None:
        """The final evaluation's line, once: a finish interrupted after writing it (before
        summary.json) left the same record, which is dropped first."""
        self._keep(lambda record: record["step"] != step or set(record) != {"step", *values})
        self.write(step, values)

    def _keep(self, keep) -> None:
        """Rewrites the file with the records `keep` accepts, without a torn last line."""
        if not self.enabled:
            return
        if not self.remote:
            if not os.path.exists(self.path):
                return
            with open(self.path, "rb") as fh:
                self.lines = [ln for ln, _ in records(self.path, fh.read())]
        self.lines = [ln for ln in self.lines if keep(_record(ln))]
        storage.write_bytes(self.path, "".join(self.lines).encode())
        if not self.remote:
            self.lines = []

    def write(self, step: int, values: dict) -> None:
        if not self.enabled:
            return
        line = json_line({"step": int(step), **values})
        if self.remote:
            self.lines.append(line)
            if time.monotonic() - self.flushed_at > self.flush_s:
                self.flush()
        else:
            with open(self.path, "a") as fh:
                fh.write(line)
        if self.tb is not None:
            self.tb.write(step, {k: v for k, v in values.items() if isinstance(v, (int, float))})
        if self.also is not None:
            self.also.log(step, values)

    def flush(self) -> None:
        if self.enabled and self.remote:
            storage.write_bytes(self.path, "".join(self.lines).encode())
            self.flushed_at = time.monotonic()
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        self.flush()  # TensorBoard's file too: it needs nothing more


class TensorBoard:
    """Scalars as a TensorBoard event file (TFRecords of Event protos), written in the
    caller's thread, so a failed write (a full disk) raises there: tensorboardX's
    SummaryWriter writes from a thread whose death left every later add_scalar blocked on
    its full queue, the run hung for good.

    `purge_step`: a SessionLog START there hides the events of earlier files with a step
    >= it (a resumed run's redone steps), as TensorBoard reads them. Each writer has its
    own file, named to sort after the earlier ones (TensorBoard reads them in name order).
    A local file is appended event by event; on gs:// (no append) the file is kept in
    memory and stored whole on flush(), as often as metrics.jsonl."""

    def __init__(self, logdir: str, purge_step: int | None):
        from tensorboardX.proto import event_pb2, summary_pb2

        self.pb, self.summary_pb = event_pb2, summary_pb2
        self.remote = storage.is_gcs(logdir)
        if not self.remote:
            os.makedirs(logdir, exist_ok=True)
        self.path = storage.join(logdir, f"events.out.tfevents.{int(time.time())}."
                                         f"{socket.gethostname()}.{time.time_ns()}")
        self.records = bytearray()  # gs://: the whole file; local: not yet appended
        self._put(event_pb2.Event(file_version="brain.Event:2"))
        if purge_step is not None:
            self._put(event_pb2.Event(step=purge_step, session_log=event_pb2.SessionLog(
                status=event_pb2.SessionLog.START)))

    def _put(self, event) -> None:
        from tensorboardX.record_writer import masked_crc32c

        event.wall_time = time.time()
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self.records += (header + struct.pack("<I", masked_crc32c(header)) + data
                         + struct.pack("<I", masked_crc32c(data)))
        if not self.remote:
            with open(self.path, "ab") as fh:
                fh.write(self.records)
            self.records.clear()

    def write(self, step: int, scalars: dict) -> None:
        value = self.summary_pb.Summary.Value
        self._put(self.pb.Event(step=int(step), summary=self.summary_pb.Summary(value=[
            value(tag=k, simple_value=float(v)) for k, v in scalars.items()])))

    def flush(self) -> None:
        if self.remote:
            storage.write_bytes(self.path, bytes(self.records))


class Progress:
    """A tqdm bar (step, loss, ETA) on the main process; silent elsewhere."""

    def __init__(self, total: int, initial: int, enabled: bool):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", file=sys.stderr,
                            mininterval=1.0, dynamic_ncols=True)

    def update(self, n: int, loss: float | None = None) -> None:
        if self.bar is not None:
            if loss is not None:  # before the update, whose refresh then shows this loss
                self.bar.set_postfix(loss=f"{loss:.3e}", refresh=False)
            self.bar.update(n)

    def say(self, line: str) -> None:
        """Prints `line` above the bar (not glued to it)."""
        if self.bar is None:
            print(line)
        else:
            self.bar.write(line, file=sys.stdout)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def table(values: dict) -> str:
    """A small aligned two-column table for the console."""
    width = max((len(k) for k in values), default=0)
    lines = []
    for k, v in sorted(values.items()):
        v = f"{v:.4g}" if isinstance(v, float) else str(v)
        lines.append(f"  {k.ljust(width)}  {v}")
    return "\n".join(lines)
