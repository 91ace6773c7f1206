"""Weights & Biases as a metric sink beside metrics.jsonl (`log.wandb`, off by default).

Process 0 only (`enabled`): the resolved config at start, every metrics.jsonl record at
its step, the figures as images and the final summary. The W&B run's id is kept in
RUN_DIR/wandb.json, written before the first `wandb.init`, so a resumed run continues the
same W&B run (`resume="allow"`); steps a resume logs again are the ones W&B already has
(it keeps the first values; metrics.jsonl holds the resumed run's, bitwise the same but
for `train/perf/`). Offline runs are written under RUN_DIR/wandb (a gs:// run dir: under
./wandb of the working directory), for `wandb sync`.

W&B is never in the way of training: any exception from it (no credentials, no network,
a full disk) is one warning naming what failed, after which this run logs to W&B no more;
metrics.jsonl, TensorBoard and the checkpoints go on as ever.
"""

from __future__ import annotations

import io
import json
import os
import secrets

from absl import logging

from ppgd_tpu import config as config_lib
from ppgd_tpu import storage

RECORD = "wandb.json"  # RUN_DIR/wandb.json: {"id", "project", "entity"} of the W&B run


class WandbSink:
    """A W&B run for a training run in `run_dir` (module docstring); every method is a
    no-op when W&B is off, not this process's, or failed before."""

    def __init__(self, cfg: config_lib.Config, run_dir: str, enabled: bool):
        self.run = None
        settings = cfg.log.wandb
        if not enabled or settings.mode == "disabled":
            return
        self._guard("start", self._start, cfg, run_dir)

    def _start(self, cfg: config_lib.Config, run_dir: str) -> None:
        import wandb

        w = cfg.log.wandb
        record = storage.join(run_dir, RECORD)
        if storage.exists(record):
            run_id = json.loads(storage.read_bytes(record))["id"]
        else:
            run_id = secrets.token_hex(6)  # W&B ids: letters, digits, - and _
            storage.write_bytes(record, json.dumps(
                {"id": run_id, "project": w.project, "entity": w.entity}, indent=1).encode())
        where = os.getcwd() if storage.is_gcs(run_dir) else run_dir
        self.run = wandb.init(
            project=w.project, entity=w.entity or None,
            name=w.name or os.path.basename(run_dir.rstrip("/")), id=run_id, resume="allow",
            tags=[t.strip() for t in w.tags.split(",") if t.strip()] or None, mode=w.mode,
            dir=where, config=config_lib.to_dict(cfg),
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True))

    def _guard(self, what: str, fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # whatever W&B raises: it must not stop training
            logging.warning("W&B %s failed (%s: %s); not logging to W&B for the rest of this "
                            "run (metrics.jsonl has every metric)", what, type(e).__name__, e)
            run, self.run = self.run, None
            if run is not None:
                try:
                    run.finish(exit_code=1, quiet=True)
                except Exception:  # already broken: nothing more to say
                    pass

    def log(self, step: int, values: dict) -> None:
        """One metrics.jsonl record (non-finite values as None, as there)."""
        if self.run is not None:
            self._guard("log", self.run.log, dict(values), int(step))

    def images(self, step: int, folder: str) -> None:
        """The PNG figures in `folder` (local or gs://), as `figures/<name>` images."""
        if self.run is not None:
            self._guard("image upload", self._images, step, folder)

    def _images(self, step: int, folder: str) -> None:
        import wandb
        from PIL import Image

        names = sorted(n for n in storage.list_files(folder) if n.endswith(".png"))
        images = {f"figures/{n.removesuffix('.png')}": wandb.Image(
            Image.open(io.BytesIO(storage.read_bytes(storage.join(folder, n)))), caption=n)
            for n in names}
        if images:
            self.run.log(images, step=int(step))

    def summary(self, values: dict) -> None:
        if self.run is not None:
            self._guard("summary", self.run.summary.update, dict(values))

    def close(self) -> None:
        """Finishes the W&B run and waits until W&B has written (offline) or sent
        (online) everything: its service process otherwise writes on after `finish`."""
        if self.run is not None:
            self._guard("finish", self._finish)
            self.run = None

    def _finish(self) -> None:
        import wandb

        self.run.finish()
        wandb.teardown()

    def __enter__(self) -> WandbSink:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
