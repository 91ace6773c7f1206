"""A jax.profiler trace of a few training steps of a run, stored in RUN_DIR/profile/.

`log.profile_start` = s traces the steps s+1 .. s+`log.profile_steps` (global step numbers,
as in metrics.jsonl) as dispatched (their host time) and as run (their device time: the
window ends with a wait for its last step, the one host sync it adds). Each process traces
itself into a local temp dir, then copies the files into
RUN_DIR/profile/plugins/profile/step_<s>/ (local or gs://) under its own name,
`<host>-p<process index>`. TensorBoard's profile plugin reads that layout (`tensorboard
--logdir RUN_DIR`), and Perfetto (ui.perfetto.dev) opens the `.trace.json.gz`. A run that
stops (or ends) inside the window keeps the steps traced up to then; one that fails there
keeps nothing; one that resumes after s traces nothing."""

from __future__ import annotations

import logging
import pathlib
import socket
import tempfile

import jax

from ppgd_tpu import dist, storage

PROFILE = "profile"  # RUN_DIR/profile


class StepTrace:
    """The trace window of one `train` command; a no-op when `start` is -1 or already past."""

    def __init__(self, run_dir: str, start: int, n_steps: int, first_step: int,
                 say=print):
        self._say = say  # the console line naming the stored trace
        self._out = storage.join(run_dir, PROFILE, "plugins", "profile", f"step_{start}")
        self._start, self._end = start, start + n_steps
        self._dir: tempfile.TemporaryDirectory | None = None
        self._last = start  # the last step dispatched inside the window
        if 0 <= start < first_step:
            logging.info("log.profile_start %d is before this command's first step %d: no "
                         "trace", start, first_step)

    def before(self, step: int) -> None:
        """Call before dispatching the step that follows global step `step`."""
        if step == self._start:
            self._dir = tempfile.TemporaryDirectory(prefix="ppgd-trace-")
            jax.profiler.start_trace(self._dir.name)

    def after(self, done: int, state) -> None:
        """Call after dispatching the step that makes `done` steps: the window's last one
        is waited for, then the trace is stored."""
        if self._dir is None:
            return
        self._last = done
        if done == self._end:
            jax.block_until_ready(state)
            self._store()

    def __enter__(self) -> StepTrace:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._dir is None:
            return
        if exc_type is None:  # the run stopped, or ended, inside the window: its steps
            self._store()
        else:
            jax.profiler.stop_trace()
            self._dir.cleanup()
            self._dir = None

    def _store(self) -> None:
        jax.profiler.stop_trace()
        local, self._dir = self._dir, None  # stopped: a failing write below is the error
        host = socket.gethostname()
        files = [p for p in pathlib.Path(local.name).rglob("*") if p.is_file()]
        try:
            for p in files:  # <stamp>/<host>.<kind>; the host name may hold dots
                kind = p.name[len(host) + 1:] if p.name.startswith(host + ".") \
                    else p.name.split(".", 1)[-1]
                storage.write_bytes(storage.join(self._out, f"{host}-p{jax.process_index()}"
                                                 f".{kind}"), p.read_bytes())
        finally:
            local.cleanup()
        if dist.is_main():
            self._say(f"profile of steps {self._start + 1}..{self._last}: {self._out}/ "
                      f"(each process's files; `tensorboard --logdir` the run dir, or "
                      "open a .trace.json.gz in ui.perfetto.dev)")
