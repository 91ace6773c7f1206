"""The run directory contract (WORKSPACE.md): what a run dir holds and how re-running behaves.

RUN_DIR/config.yaml is written ONCE, when the run starts; a later command on the same dir
must resolve to the same trajectory (fields under RESUMABLE_PREFIXES may differ) or it is
refused with a diff, before anything in the dir is touched. RUN_DIR/summary.json marks a
complete run: re-running it reports "already complete" and changes nothing.
"""

from __future__ import annotations

import json
import os
import time

import yaml

from ppgd_tpu import config as config_lib
from ppgd_tpu import storage
from ppgd_tpu.config import Config, ConfigError

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
DECOMPOSITION = "decomposition.safetensors"
TARGET = "target.json"
FIGURES = "figures"


def default_run_dir(cfg: Config) -> str:
    return os.path.join("runs", f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")


class RunDir:
    """A run directory on local disk or gs://bucket/path (ppgd_tpu.storage)."""

    def __init__(self, path: str):
        try:
            self.path = storage.normalize(path)
        except ValueError as e:
            raise ConfigError(f"--run_dir: {e}") from None

    def file(self, name: str) -> str:
        return storage.join(self.path, name)

    @property
    def exists(self) -> bool:
        return storage.exists(self.file(CONFIG))

    @property
    def complete(self) -> bool:
        return storage.exists(self.file(SUMMARY))

    def stored_config(self) -> Config:
        data = yaml.safe_load(storage.read_bytes(self.file(CONFIG))) or {}
        return config_lib.from_dict(Config, data)

    def check_compatible(self, cfg: Config) -> None:
        """Refuses a config whose trajectory differs from the one this dir was started with."""
        try:
            old = self.stored_config()
        except ConfigError as e:
            raise ConfigError(f"--run_dir: {self.path} holds a config this version cannot "
                              f"read ({e}); use a new --run_dir") from None
        # A run that recorded its target's weights may find them at another path (a copy on
        # gs://, another host's disk): check_target then compares the weights themselves.
        moved = ("target.path",) if storage.exists(self.file(TARGET)) else ()
        diff = config_lib.trajectory_diff(old, cfg, also_resumable=moved)
        if diff:
            raise ConfigError(
                f"--run_dir: {self.path} was started with a different config; these fields "
                "change the trajectory and may not differ on resume:\n" + "\n".join(diff)
                + "\n(use a new --run_dir, or the original values)")

    def check_creatable(self) -> None:
        try:
            storage.check_creatable(self.path, directory=True)
        except ValueError as e:
            raise ConfigError(f"--run_dir: {e}") from None

    def create(self, cfg: Config, target_sha256: str) -> None:
        """target.json, then config.yaml: the file whose presence makes the run exist."""
        storage.write_bytes(self.file(TARGET), json.dumps(
            {"sha256": target_sha256, "kind": cfg.target.kind, "path": cfg.target.path},
            indent=1).encode())
        storage.write_bytes(self.file(CONFIG), config_lib.dump_yaml(cfg).encode())

    def check_target(self, cfg: Config, target_sha256: str) -> None:
        """[C1] a resumed run rebuilds its frozen target: refuses other weights than the ones
        it started with (a target file overwritten or retrained) [C3]. Run dirs from before
        target.json are not checked."""
        if not storage.exists(self.file(TARGET)):
            return
        try:
            started = json.loads(storage.read_bytes(self.file(TARGET)))
            sha, path = started["sha256"], started["path"]
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(
                f"--run_dir: {self.file(TARGET)} is not the record this package writes ({e!r}); "
                "restore it, or delete it to resume without checking the target's "
                "weights") from None
        if sha != target_sha256:
            where = cfg.target.path or "the toy target cache (retrained from its config)"
            raise ConfigError(
                f"target: the weights now at {where} differ from those {self.path} was started "
                f"with (sha256 {target_sha256[:16]}... now, {sha[:16]}... then, from "
                f"{path or 'the toy target cache'}); restore them, or use a new --run_dir")

    def read_summary(self) -> dict:
        """The final evaluation; written whole by this package, so unreadable JSON means the
        file was changed by hand."""
        try:
            return json.loads(storage.read_bytes(self.file(SUMMARY)))
        except ValueError as e:
            raise ConfigError(
                f"--run_dir: {self.file(SUMMARY)} marks this run complete but is not valid "
                f"JSON ({e}); restore it, or delete it to run the final evaluation again "
                "from the last checkpoint") from None

    def write_summary(self, summary: dict) -> None:
        storage.write_bytes(self.file(SUMMARY),
                            json.dumps(summary, indent=1, sort_keys=True).encode())
