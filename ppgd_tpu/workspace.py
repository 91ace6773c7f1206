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

from ppgd_tpu import config as config_lib
from ppgd_tpu.config import Config, ConfigError

CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
DECOMPOSITION = "decomposition.safetensors"
FIGURES = "figures"


def default_run_dir(cfg: Config) -> str:
    return os.path.join("runs", f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")


class RunDir:
    def __init__(self, path: str):
        self.path = path

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    @property
    def exists(self) -> bool:
        return os.path.exists(self.file(CONFIG))

    @property
    def complete(self) -> bool:
        return os.path.exists(self.file(SUMMARY))

    def stored_config(self) -> Config:
        data = config_lib.load_yaml(self.file(CONFIG))
        return config_lib.from_dict(Config, data)

    def check_compatible(self, cfg: Config) -> None:
        """Refuses a config whose trajectory differs from the one this dir was started with."""
        try:
            old = self.stored_config()
        except ConfigError as e:
            raise ConfigError(f"--run_dir: {self.path} holds a config this version cannot "
                              f"read ({e}); use a new --run_dir") from None
        diff = config_lib.trajectory_diff(old, cfg)
        if diff:
            raise ConfigError(
                f"--run_dir: {self.path} was started with a different config; these fields "
                "change the trajectory and may not differ on resume:\n" + "\n".join(diff)
                + "\n(use a new --run_dir, or the original values)")

    def create(self, cfg: Config) -> None:
        os.makedirs(self.path, exist_ok=True)
        tmp = self.file(CONFIG + ".tmp")
        with open(tmp, "w") as fh:
            fh.write(config_lib.dump_yaml(cfg))
        os.replace(tmp, self.file(CONFIG))

    def write_summary(self, summary: dict) -> None:
        tmp = self.file(SUMMARY + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(summary, fh, indent=1, sort_keys=True)
        os.replace(tmp, self.file(SUMMARY))
