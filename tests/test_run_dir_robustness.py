"""A run dir (and the toy target cache) that is damaged, hand-edited, unwritable or in use
by another command: a clear refusal (exit 2, naming the file and the way out, before any
compute, nothing in the dir touched), or, for the cache, a warning and a run that goes on
(WORKSPACE.md). Real files, real permissions, real processes.

Permission bits do not stop root: as root, a read-only directory is a read-only bind mount
(skipped where mounting is not allowed) and an unwritable cache is a path under a file.
"""

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import snapshot
from safetensors import numpy as safetensors_numpy

from ppgd_tpu import cli, storage
from ppgd_tpu import config as config_lib
from ppgd_tpu.config import ConfigError
from ppgd_tpu.targets import build
from ppgd_tpu.workspace import RunDir

N = 8
FLAGS = ["--data.batch_size=32", "--eval.batch_size=64", "--eval.every=0", "--eval.pgd_steps=1",
         "--eval.figures=false", "--log.progress=false", "--log.tensorboard=false",
         "--decomp.faithfulness_warmup_steps=3"]
ARGS = [f"--decomp.steps={N}", "--log.every=2", "--checkpoint.every=4", *FLAGS]


def _train(run_dir, *extra) -> int:
    return cli.run(["train", f"--run_dir={run_dir}", *ARGS, *extra])


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A real run dir as a stop after its step-4 checkpoint leaves it: config.yaml,
    target.json, metrics.jsonl, ckpts/4, no summary."""
    run = tmp_path_factory.mktemp("runs") / "stopped"
    assert _train(run) == 0
    for name in ("summary.json", "decomposition.safetensors"):
        os.remove(run / name)
    shutil.rmtree(run / "ckpts" / str(N))
    return run


@pytest.fixture
def run(stopped_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(stopped_run, copy)
    return copy


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """A fresh PPGD_TPU_CACHE: a command that builds no target leaves it absent."""
    path = tmp_path / "cache"
    monkeypatch.setenv("PPGD_TPU_CACHE", str(path))
    return path


# ------------------------------------------------------------------- A: config.yaml edited


@pytest.mark.parametrize("edit,needle", [
    (lambda text: text + "decomp: {steps: [\n", "is not valid YAML (expected"),
    (lambda text: "- name: tms\n- seed: 0\n", "must hold a mapping"),
    (lambda text: "", "is empty"),
    (lambda text: "# cleared by hand\n", "is empty"),
], ids=["invalid", "list", "empty", "comment-only"])
def test_A_a_hand_edited_config_yaml_is_refused_naming_it(run, empty_cache, capsys, edit,
                                                           needle):
    """Never a YAML traceback, and never the embedded default config in place of an empty
    file; with the run's flags or none, before the target is built, nothing touched."""
    config_yaml = run / "config.yaml"
    config_yaml.write_text(edit(config_yaml.read_text()))
    before = snapshot(run)
    for argv in (ARGS, []):  # no flags: the embedded default, which an empty file once was
        rc = cli.run(["train", f"--run_dir={run}", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and f"--run_dir: {config_yaml} {needle}" in err, err
        assert "restore the original, or use a new --run_dir" in err
    assert snapshot(run) == before and not empty_cache.exists()


# ------------------------------------------------------------------- B: config.yaml missing


@pytest.mark.parametrize("keep", ["all but config.yaml", "metrics.jsonl", "ckpts"])
def test_B_a_run_dir_with_files_but_no_config_yaml_is_refused_not_started_over(
        run, empty_cache, capsys, keep):
    """Its checkpoints would otherwise be resumed under whatever config this command has."""
    os.remove(run / "config.yaml")
    if keep != "all but config.yaml":
        for name in os.listdir(run):
            if name != keep:
                (shutil.rmtree if (run / name).is_dir() else os.remove)(run / name)
    before = snapshot(run)
    rc = _train(run)
    err = capsys.readouterr().err
    shown = {"all but config.yaml": "ckpts/, metrics.jsonl", "metrics.jsonl": "metrics.jsonl",
             "ckpts": "ckpts/"}[keep]  # not .lock nor target.json: see the next test
    assert rc == 2, err
    assert f"--run_dir: {run} is not empty (it holds {shown}) but has no config.yaml" in err, err
    assert "Use a new --run_dir" in err and f"restore {run / 'config.yaml'}" in err
    assert snapshot(run) == before and not empty_cache.exists()


def test_B_what_an_interrupted_start_leaves_is_still_a_new_run_dir(tmp_path):
    """The lock, target.json / temp files of a start killed before config.yaml landed, and
    the worker logs tpu_pod.sh copies there after a pod attempt that failed before it (a
    mistyped flag: refused, that dir could never have been started)."""
    d = tmp_path / "d"
    RunDir(str(d)).check_creatable()  # does not exist
    d.mkdir()
    RunDir(str(d)).check_creatable()  # empty
    for name in (".lock", "target.json", "config.yaml.tmp-0123abcd", "target.json.tmp-4567"):
        (d / name).write_text("x")
    (d / "launch_logs" / "20261206-010203").mkdir(parents=True)
    (d / "launch_logs" / "20261206-010203" / "worker-0.log").write_text("--decomp.stepz")
    RunDir(str(d)).check_creatable()
    (d / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds notes.txt\) but has no config.yaml"):
        RunDir(str(d)).check_creatable()


def test_B_on_gcs_a_prefix_with_checkpoints_but_no_config_yaml_is_refused(gcs_emulator):
    run = gcs_emulator.run_dir()
    RunDir(run).check_creatable()  # nothing there: new
    storage.write_bytes(f"{run}/launch_logs/20261206-010203/worker-0.log", b"a failed try")
    RunDir(run).check_creatable()  # a pod attempt's logs only (tpu_pod.sh): still new
    storage.write_bytes(f"{run}/ckpts/4/manifest.json", b"{}")
    with pytest.raises(ConfigError, match=r"is not empty \(it holds ckpts/\) but has no "):
        RunDir(run).check_creatable()


# ------------------------------------------------------------------- C: unwritable cache


def _unwritable_cache(tmp_path, how: str):
    """A cache root no write gets into, as this user (a read-only dir stops only non-root)."""
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    if how == "read-only dir":
        root = tmp_path / "ro_cache"
        root.mkdir()
        root.chmod(0o555)
        if not os.access(root, os.W_OK):
            return root
        root.chmod(0o755)  # root: permission bits do not stop it; a file in the path does
        return afile / "cache"
    return afile


@pytest.mark.parametrize("how", ["read-only dir", "a file"])
def test_C_an_unwritable_cache_warns_and_the_run_uses_the_trained_target(tmp_path, monkeypatch,
                                                                         caplog, how):
    """A cache is an optimisation: the run goes on (exit 0) with the target it trained, and
    one warning names the file, PPGD_TPU_CACHE and what it must be."""
    cfg = config_lib.load(None)
    want = build.fingerprint(build.build(cfg.target), cfg.target)  # the session's cache
    cache_root = _unwritable_cache(tmp_path, how)
    monkeypatch.setenv("PPGD_TPU_CACHE", str(cache_root))
    before = snapshot(tmp_path / "ro_cache") if (tmp_path / "ro_cache").exists() else None
    caplog.set_level(logging.WARNING)
    try:
        assert _train(tmp_path / "r") == 0
    finally:
        if (tmp_path / "ro_cache").exists():
            (tmp_path / "ro_cache").chmod(0o755)
    warnings = [r.getMessage() for r in caplog.records if "cannot cache" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert build.cache_path(cfg.target) in warnings[0]
    assert f"the cache root {cache_root} (PPGD_TPU_CACHE" in warnings[0]
    assert "must be a directory this user can write" in warnings[0]
    assert (tmp_path / "r" / "summary.json").exists()
    assert (tmp_path / "afile").read_text() == "not a directory"
    if before is not None:
        assert snapshot(tmp_path / "ro_cache") == before
    assert json.loads((tmp_path / "r" / "target.json").read_text())["sha256"] == want


# --------------------------------------------------- G: damaged files a resumed run appends to


@pytest.mark.parametrize("damage", ["not utf-8", "cut mid-line", "no step", "not an object"])
def test_G_a_metrics_jsonl_damaged_before_its_last_line_is_refused_naming_the_line(
        run, empty_cache, capsys, damage):
    """Only a kill's torn LAST line is dropped on resume; a damaged line before it was
    edited or corrupted, and dropping it silently would lose a record: exit 2 naming the
    file and the line, before the target is built, nothing touched. Deleting the line, as
    the message says, resumes."""
    metrics = run / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    bad = {"not utf-8": b'{"step": 3, "note": "\xff\xfe"}\n', "cut mid-line": b'{"step": 3, "tr\n',
           "no step": b'{"train/loss/total": 1.0}\n', "not an object": b"[3]\n"}[damage]
    metrics.write_bytes(b"".join([lines[0], bad, *lines[1:]]))
    before = snapshot(run)
    rc = _train(run)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"--run_dir: {metrics}: line 2 is not a metrics record" in err, err
    assert "delete that line" in err and "Traceback" not in err
    assert snapshot(run) == before and not empty_cache.exists()
    metrics.write_bytes(b"".join(lines))
    assert _train(run) == 0 and (run / "summary.json").exists()


@pytest.mark.parametrize("name", ["tb", "figures", "profile", "ckpts"])
def test_G_a_file_where_the_run_keeps_a_directory_is_refused_naming_it(run, empty_cache,
                                                                         capsys, name):
    path = run / name
    if path.is_dir():
        shutil.move(path, run.parent / f"{name}.saved")
    path.write_text("not a directory")
    before = snapshot(run)
    rc = _train(run, "--log.tensorboard=true", "--eval.figures=true")
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"--run_dir: {path} is a file; the run keeps a directory there" in err, err
    assert snapshot(run) == before and not empty_cache.exists()
    path.unlink()
    if (run.parent / f"{name}.saved").exists():
        shutil.move(run.parent / f"{name}.saved", path)
    assert _train(run, "--log.tensorboard=true", "--eval.figures=true") == 0
    assert (run / "summary.json").exists() and (run / "tb").is_dir()


# ------------------------------------------------------------- H: a write that fails mid-run


@pytest.mark.parametrize("sink", ["tensorboard", "metrics.jsonl"])
def test_H_a_metrics_write_that_fails_raises_instead_of_hanging(tmp_path, sink):
    """A full disk, as a real file-size limit in a real process: the write raises OSError
    (File too large) in the loop's thread. TensorBoard's old writer thread died of it and
    left every later write blocked on its full queue: the run hung for good."""
    code = f"""
import resource
from ppgd_tpu import metrics
resource.setrlimit(resource.RLIMIT_FSIZE, (8192, 8192))
if {sink == "tensorboard"}:  # MetricsWriter's TensorBoard sink alone
    w = metrics.TensorBoard({str(tmp_path / "tb")!r}, purge_step=None)
else:
    w = metrics.MetricsWriter({str(tmp_path)!r}, enabled=True, tensorboard=False)
for step in range(10000):
    w.write(step, {{f"train/some/metric_{{k}}": 1.5 for k in range(20)}})
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and "OSError: [Errno 27] File too large" in p.stderr, p.stderr[-2000:]


def test_H_an_atomic_write_that_fails_leaves_no_temp_file(tmp_path):
    """storage.write_bytes writes a sibling temp file and renames it; when the rename fails
    (here: a directory in the way; a read-only bind mount of the file, a full disk mid-write
    fail alike) the temp file goes with the error instead of lingering beside the run's."""
    (tmp_path / "metrics.jsonl").mkdir()
    (tmp_path / "metrics.jsonl" / "keep").write_text("x")
    with pytest.raises(OSError):
        storage.write_bytes(str(tmp_path / "metrics.jsonl"), b"{}\n")
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl"]


# ------------------------------------------------------------------- D: unwritable run dir


@contextlib.contextmanager
def _read_only(path):
    """`path` read-only for this process: mode 0o555, or as root a read-only bind mount."""
    mode = os.stat(path).st_mode
    os.chmod(path, 0o555)
    if not os.access(path, os.W_OK):
        try:
            yield
        finally:
            os.chmod(path, mode)
        return
    os.chmod(path, mode)  # root: permission bits do not stop it
    p = subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(path)],
                       capture_output=True, text=True)
    if p.returncode:
        pytest.skip(f"running as root, and a read-only bind mount is refused: {p.stderr}")
    try:
        yield
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("where", [".", "ckpts"])
def test_D_resuming_a_run_dir_that_cannot_be_written_is_refused_before_compute(
        run, empty_cache, capsys, where):
    """As a new dir that could not be created is: exit 2 naming the dir, before the target
    is built (the empty cache stays empty) or anything restored; nothing touched."""
    path = os.path.normpath(run / where)
    with _read_only(path):
        before = snapshot(run)
        rc = _train(run)
        err = capsys.readouterr().err
        assert snapshot(run) == before
    assert rc == 2, err
    assert (f"--run_dir: no permission to write in {path}, so the run in {run} cannot be "
            "resumed" in err or f"--run_dir: {path} is on a read-only file system" in err), err
    assert "make it writable, or copy the run dir" in err
    assert not empty_cache.exists()
    assert _train(run) == 0  # writable again: it resumes
    with open(run / ".lock") as fh:  # and its lock went with the command's end
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)


# ------------------------------------------------------------------- E: damaged cached target


@pytest.mark.parametrize("damage,needle", [
    ("truncated", "is not a readable safetensors file"),
    ("garbage", "is not a readable safetensors file"),
    ("zeroed", "holds weights that fail validation"),
])
def test_E_a_damaged_cached_toy_target_is_trained_again_and_replaced(tmp_path, monkeypatch,
                                                                     caplog, damage, needle):
    """The cache holds a pure function of the config: a file there that does not load is a
    warning naming it, not an error about a target.path the user never set."""
    cfg = config_lib.load(None)
    good = build.build(cfg.target)  # the session's cache (conftest): trained once
    want = build.fingerprint(good, cfg.target)
    with open(build.cache_path(cfg.target), "rb") as fh:
        data = fh.read()
    monkeypatch.setenv("PPGD_TPU_CACHE", str(tmp_path / "cache"))
    path = build.cache_path(cfg.target)
    os.makedirs(os.path.dirname(path))
    if damage == "zeroed":  # a readable file of the right shapes: the check refuses it
        zeroed = {k: np.zeros_like(v) for k, v in safetensors_numpy.load(data).items()}
        data = safetensors_numpy.save(zeroed)
    with open(path, "wb") as fh:
        fh.write({"truncated": data[: len(data) // 2], "garbage": b"\0" * 64}.get(damage, data))
    caplog.set_level(logging.WARNING)
    assert _train(tmp_path / "r") == 0
    warnings = [r.getMessage() for r in caplog.records if "toy target cache" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"the toy target cache: {path} {needle}" in warnings[0]
    assert "training the target again" in warnings[0] and "target.path" not in warnings[0]
    assert build.fingerprint(build.load(cfg.target, path), cfg.target) == want  # replaced


# ------------------------------------------------------------------- F: one command per dir


def _holder_alive_with_config(proc, run_dir, timeout=300):
    deadline = time.time() + timeout
    while not (run_dir / "config.yaml").exists():
        if proc.poll() is not None:
            raise AssertionError(f"the first command ended: {proc.communicate()[0][-3000:]}")
        assert time.time() < deadline, "the first command never started its run"
        time.sleep(0.1)


def test_F_a_second_command_on_a_run_dir_in_use_is_refused_and_a_killed_holder_leaves_none(
        tmp_path, capsys):
    """Two `train` commands in one dir would interleave metrics and checkpoints: while one
    runs, another (process, or call in this one) exits 2 naming the dir and the holder's pid;
    the holder SIGKILLed, its lock is gone with it (the kernel drops flocks)."""
    run = tmp_path / "busy"
    cmd = [sys.executable, "-m", "ppgd_tpu.cli", "train", f"--run_dir={run}",
           "--decomp.steps=1000000", "--log.every=1000", "--checkpoint.every=0", *FLAGS]
    holder = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _holder_alive_with_config(holder, run)
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr[-3000:]
        want = f"--run_dir: {run} is in use by another ppgd-tpu command (pid {holder.pid} on host"
        assert want in second.stderr, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        assert cli.run(cmd[3:]) == 2  # `train --run_dir=...` in this process
        assert want in capsys.readouterr().err
        assert holder.poll() is None  # the holder was not disturbed
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.communicate()
    rd = RunDir(str(run))
    rd.lock()  # no stale lock: taken at once
    rd.release()


def test_F_a_new_run_refused_by_the_lock_exits_2_in_every_process(tmp_path):
    """Two processes (no launcher to kill the rest) start a new run in a dir whose lock
    another command holds: process 0 is refused when it creates the dir's files, and
    process 1 must exit 2 with it, not wait at the next barrier for a process that left."""
    from ppgd_tpu.launch_local import child_env, free_port

    run = tmp_path / "held"
    holder = RunDir(str(run))
    holder.lock()  # this pytest process is "another command"
    port = free_port()
    cmd = [sys.executable, "-m", "ppgd_tpu.cli", "train", f"--run_dir={run}", *ARGS]
    procs = [subprocess.Popen(cmd, env=child_env(i, 2, 1, port), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]  # the barrier waits 300 s
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
        holder.release()
    want = f"--run_dir: {run} is in use by another ppgd-tpu command (pid {os.getpid()} on host"
    for index, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 2, f"process {index}:\n{out[-3000:]}"
        assert want in out and "Traceback" not in out, f"process {index}:\n{out[-3000:]}"
    assert sorted(os.listdir(run)) == [".lock"]  # nothing of the refused run was written
