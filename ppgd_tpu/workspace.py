"""The run directory contract (WORKSPACE.md): what a run dir holds and how re-running behaves.

RUN_DIR/config.yaml is written ONCE, when the run starts; a later command on the same dir
must resolve to the same trajectory (fields under RESUMABLE_PREFIXES may differ) or it is
refused with a diff, before anything in the dir is touched. RUN_DIR/summary.json marks a
complete run: re-running it reports "already complete" and changes nothing.

A local run dir is held by one command at a time: RUN_DIR/.lock, flock'ed by the main
process from the moment the command may write there until it ends (the kernel releases it
when the process dies, even by SIGKILL, so a lock is never stale). gs:// run dirs are not
locked.
"""

from __future__ import annotations

import json
import os
import time

import yaml
from absl import logging

from ppgd_tpu import config as config_lib
from ppgd_tpu import dist, lockfile, storage
from ppgd_tpu import metrics as metrics_lib
from ppgd_tpu.checkpoint import manifest
from ppgd_tpu.config import Config, ConfigError
from ppgd_tpu.trace import PROFILE

CONFIG = "config.yaml"
METRICS = metrics_lib.METRICS
SUMMARY = "summary.json"
DECOMPOSITION = "decomposition.safetensors"
TARGET = "target.json"
STORE = "data.json"
FIGURES = "figures"
EVALS = "evals"  # `ppgd-tpu eval`'s outputs, evals/step_<s>/ (train never touches them)
LOCK = ".lock"
LAUNCH_LOGS = "launch_logs"  # launch/tpu_pod.sh's copies of each attempt's worker logs
# What a dir may hold and still be a new run dir: the lock, what create() leaves when it is
# killed before config.yaml lands (target.json, the temp names of atomic writes), and the
# logs of a pod attempt that failed before that (a mistyped flag): its re-run must start.
_CREATION_LEFTOVERS = (LOCK, TARGET, STORE, LAUNCH_LOGS + "/")
_TEMP_MARK = ".tmp-"  # storage.write_bytes: "<name>.tmp-<hex>", renamed when whole


def default_run_dir(cfg: Config) -> str:
    return os.path.join("runs", f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def _acquire(path: str) -> int | None:
    """Takes `path`/.lock (lockfile.acquire), refusing while another command holds it."""
    lock_file = os.path.join(path, LOCK)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:  # e.g. under /proc, or a full or read-only filesystem
        raise ConfigError(f"--run_dir: cannot create the directory {path} "
                          f"({e.strerror or e}); give a path this user can create") from None
    try:
        return lockfile.acquire(lock_file)
    except lockfile.Held as e:
        raise ConfigError(
            f"--run_dir: {path} is in use by another ppgd-tpu command ({e.holder}, per "
            f"{lock_file}); two commands in one run dir would interleave its metrics and "
            "checkpoints. Wait for it to end, or stop it (SIGTERM saves a checkpoint) and "
            "re-run this command to resume, or use a new --run_dir") from None
    except OSError as e:  # e.g. a .lock another user made, read-only to this one
        raise ConfigError(f"--run_dir: cannot open {lock_file} to lock the run dir "
                          f"({e.strerror or e}); this user must be able to write it") from None


def _unwritable(path: str) -> str | None:
    """Why a command could not write the local run dir `path` (it or a dir below it: new
    checkpoints, metrics, TensorBoard events, retention deleting old steps), or None."""
    for here, dirs, _ in os.walk(path):
        if not os.access(here, os.W_OK | os.X_OK):
            try:
                read_only = bool(os.statvfs(here).f_flag & os.ST_RDONLY)
            except OSError:
                read_only = False
            return (f"{here} is on a read-only file system" if read_only
                    else f"no permission to write in {here}")
        dirs.sort()
    return None


def _refuse_together(problem: str | None) -> None:
    """Raises ConfigError in every process if any process saw a `problem`, so all exit 2
    together rather than some waiting at a barrier for one that left."""
    for index, p in enumerate(dist.gather_from_all(problem)):
        if p:
            raise ConfigError(p + (f" (seen by process {index})" if index else ""))


class RunDir:
    """A run directory on local disk or gs://bucket/path (ppgd_tpu.storage)."""

    def __init__(self, path: str):
        try:
            self.path = storage.normalize(path)
        except ValueError as e:
            raise ConfigError(f"--run_dir: {e}") from None
        self._lock_fd: int | None = None

    def file(self, name: str) -> str:
        return storage.join(self.path, name)

    @property
    def exists(self) -> bool:
        return storage.exists(self.file(CONFIG))

    @property
    def complete(self) -> bool:
        return storage.exists(self.file(SUMMARY))

    def _stored_mapping(self) -> dict:
        """config.yaml as written by create(): a YAML mapping. Anything else was damaged or
        edited by hand, and is refused naming the file (never read as the default config)."""
        where = self.file(CONFIG)
        fix = ("it is written once, when the run starts, and never rewritten: restore the "
               "original, or use a new --run_dir")
        try:
            text = storage.read_bytes(where)
        except OSError as e:
            raise ConfigError(f"--run_dir: cannot read {where} "
                              f"({e.strerror or e}); {fix}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"--run_dir: {where} is not valid YAML "
                              f"({config_lib.yaml_problem(e)}); {fix}") from None
        if data is None:
            raise ConfigError(f"--run_dir: {where} is empty; {fix}")
        if not isinstance(data, dict):
            raise ConfigError(f"--run_dir: {where} must hold a mapping (the run's config, "
                              f"`field: value`), not a {type(data).__name__}; {fix}")
        return data

    def stored_config(self) -> Config:
        data = self._stored_mapping()
        try:
            return config_lib.from_dict(Config, data)
        except ConfigError as e:
            raise ConfigError(f"--run_dir: {self.path} holds a config this version cannot "
                              f"read ({e}); use a new --run_dir") from None

    def lock(self) -> None:
        """Holds RUN_DIR/.lock for this process (main process only; nothing for gs://) until
        release(); refuses (ConfigError) while another live command holds it, naming its pid
        and host. The kernel drops the lock when its process dies."""
        if self._lock_fd is None and not storage.is_gcs(self.path) and dist.is_main():
            self._lock_fd = _acquire(self.path)

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def check_compatible(self, cfg: Config) -> None:
        """Refuses a config whose trajectory differs from the one this dir was started with.

        For a run that is not complete (it will be resumed, so written), also refuses a
        local dir this process could not write and one another command holds, and takes its
        lock (main process): every process learns of any one's refusal, before compute."""
        old = self.stored_config()
        # A run that recorded its target's weights may find them at another path (a copy on
        # gs://, another host's disk): check_target then compares the weights themselves.
        moved = (("target.path",) if storage.exists(self.file(TARGET)) else ()) + (
            ("data.store",) if storage.exists(self.file(STORE)) else ())
        diff = config_lib.trajectory_diff(old, cfg, also_resumable=moved)
        if diff:
            fresh = not self.complete and manifest.latest_step(self.path) is None
            raise ConfigError(
                f"--run_dir: {self.path} was started with a different config; these fields "
                "change the trajectory and may not differ on resume:\n" + "\n".join(diff)
                + "\n(use a new --run_dir, or the original values"
                + (f"; that run has no checkpoint yet: to start it over with this config, "
                   f"remove {self.path})" if fresh else ")"))
        if self.complete:  # nothing will be written: reported "already complete"
            return
        problem = None
        if not storage.is_gcs(self.path):
            problem = _unwritable(self.path)
            if problem:
                problem = (f"--run_dir: {problem}, so the run in {self.path} cannot be resumed; "
                           "make it writable, or copy the run dir somewhere writable and "
                           "resume the copy")
        if problem is None:
            try:
                self.lock()
            except ConfigError as e:
                problem = str(e)
        if problem is None and dist.is_main():
            problem = self._damaged()
        _refuse_together(problem)

    def _damaged(self) -> str | None:
        """Why the files a resumed run appends to could not be used: a metrics.jsonl
        damaged before its last line, or a file where the run keeps a directory."""
        for where in (self.file(metrics_lib.TENSORBOARD), self.file(FIGURES),
                      self.file(PROFILE), manifest.ckpts_dir(self.path)):
            if not storage.is_gcs(self.path) and os.path.isfile(where):
                return (f"--run_dir: {where} is a file; the run keeps a directory there: "
                        "move the file away to resume")
        try:
            data = storage.read_bytes(self.file(METRICS))
        except FileNotFoundError:
            return None
        except OSError as e:
            return f"--run_dir: cannot read {self.file(METRICS)} ({e}); it must be a file"
        try:
            metrics_lib.records(self.file(METRICS), data)
        except ValueError as e:
            return f"--run_dir: {e}"
        return None

    def check_creatable(self) -> None:
        """A new run may start here: the dir can be created and written (local), and it is
        empty but for what an interrupted create() leaves. A dir with anything else but no
        config.yaml (checkpoints, metrics) was not made by this tool or lost its config.yaml:
        resuming its checkpoints under whatever config is given would be wrong."""
        try:
            storage.check_creatable(self.path, directory=True)
        except ValueError as e:
            raise ConfigError(f"--run_dir: {e}") from None
        extra = [n for n in storage.list_entries(self.path) if n not in _CREATION_LEFTOVERS
                 and not n.startswith(tuple(f + _TEMP_MARK for f in (CONFIG, TARGET, STORE)))]
        if extra:
            shown = ", ".join(extra[:6]) + (f", ... ({len(extra)} entries)"
                                             if len(extra) > 6 else "")
            raise ConfigError(
                f"--run_dir: {self.path} is not empty (it holds {shown}) but has no {CONFIG}: "
                f"it was not made by `ppgd-tpu train`, or its {CONFIG} was deleted. Use a new "
                f"--run_dir (a new or empty directory), or restore {self.file(CONFIG)} to "
                "resume that run")

    def create(self, cfg: Config, target_sha256: str, store_id: str | None = None) -> None:
        """target.json, then config.yaml: the file whose presence makes the run exist.
        Every process calls it; the main one writes. Takes the dir's lock first (a new dir
        is locked here, once the target is built): refuses if another command holds it, or
        started the run since check_creatable, and then every process refuses with it (none
        is left waiting for the main one at the next barrier)."""
        problem = None
        if dist.is_main():
            try:
                self._create(cfg, target_sha256, store_id)
            except ConfigError as e:
                problem = str(e)
        _refuse_together(problem)

    def _create(self, cfg: Config, target_sha256: str, store_id: str | None) -> None:
        self.lock()
        if storage.exists(self.file(CONFIG)):
            raise ConfigError(
                f"--run_dir: another command started a run in {self.path} while this one "
                "built its target; re-run this command to resume that run, or use a new "
                "--run_dir")
        storage.write_bytes(self.file(TARGET), json.dumps(
            {"sha256": target_sha256, "kind": cfg.target.kind, "path": cfg.target.path},
            indent=1).encode())
        if store_id is not None:
            storage.write_bytes(self.file(STORE), json.dumps(
                {"store_id": store_id, "store": cfg.data.store}, indent=1).encode())
        storage.write_bytes(self.file(CONFIG), config_lib.dump_yaml(cfg).encode())

    def drop_torn_writes(self) -> None:
        """Deletes what atomic writes killed mid-way left (`<name>.tmp-<hex>`, never read:
        only the rename makes a file whole) in the dir and figures/. Main process, after
        check_compatible or create took the lock; gs:// uploads leave none."""
        if storage.is_gcs(self.path) or not dist.is_main():
            return
        for where in (self.path, self.file(FIGURES)):
            for name in storage.list_entries(where):
                if _TEMP_MARK in name and not name.endswith("/"):
                    logging.info("removing %s, left by a write that was killed", name)
                    storage.remove(storage.join(where, name))

    def _started_with(self, name: str, keys: tuple[str, ...], what: str) -> tuple | None:
        """The `keys` of the record `name` that create() wrote (None: a run dir from before
        it, not checked)."""
        if not storage.exists(self.file(name)):
            return None
        try:
            started = json.loads(storage.read_bytes(self.file(name)))
            return tuple(started[k] for k in keys)
        except (ValueError, TypeError, KeyError) as e:
            raise ConfigError(
                f"--run_dir: {self.file(name)} is not the record this package writes ({e!r}); "
                f"restore it, or delete it to resume without checking {what}") from None

    def check_inputs(self, cfg: Config, target_sha256: str, store_id: str | None) -> None:
        """[C1] a resumed run rebuilds its frozen target and reopens its token store: refuses
        other weights than the ones it started with (a target file overwritten or retrained)
        and a store rewritten since (other rows under the same batch ids) [C3]."""
        self._check_target(cfg, target_sha256)
        started = self._started_with(STORE, ("store_id", "store"), "the token store")
        if started and store_id is not None and started[0] != store_id:
            raise ConfigError(
                f"data.store: the token store at {cfg.data.store} is not the one {self.path} was "
                f"started with (store id {store_id[:12]}... now, {started[0][:12]}... then, at "
                f"{started[1]}): its rows differ (written again since, from another corpus or with "
                "other settings), so the batches would differ from the uninterrupted run's; "
                "restore that store, or use a new --run_dir")

    def _check_target(self, cfg: Config, target_sha256: str) -> None:
        started = self._started_with(TARGET, ("sha256", "path"), "the target's weights")
        if started is None:
            return
        sha, path = started
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
        except IsADirectoryError:
            raise ConfigError(f"--run_dir: {self.file(SUMMARY)} is a directory; the file "
                              "marks a run complete: move it away to run the final evaluation "
                              "again from the last checkpoint") from None
        except ValueError as e:
            raise ConfigError(
                f"--run_dir: {self.file(SUMMARY)} marks this run complete but is not valid "
                f"JSON ({e}); restore it, or delete it to run the final evaluation again "
                "from the last checkpoint") from None


def write_summary(path: str, summary: dict) -> None:
    """summary.json: flat keys, sorted (a run's final eval, or `ppgd-tpu eval`'s)."""
    storage.write_bytes(path, json.dumps(metrics_lib.json_values(summary), indent=1,
                                         sort_keys=True, allow_nan=False).encode())
