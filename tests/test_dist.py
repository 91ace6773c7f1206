"""ppgd_tpu.dist with real processes: 2 processes x 2 CPU devices over gloo on localhost.

Each multi-process case starts tests/dist_worker.py in subprocesses with the PPGD_*
environment the launcher would set (JAX never starts in the pytest process).
"""

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ppgd_tpu import dist
from ppgd_tpu.launch_local import child_env, free_port

ROOT = Path(__file__).resolve().parents[1]
WORKER = str(ROOT / "tests" / "dist_worker.py")
TIMEOUT_S = 60


class Proc:
    """A child process whose merged output is read line by line in the background."""

    def __init__(self, args, env):
        env = {**env, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
        self.p = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            self.lines.append(line)
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, prefix):
        """Block until a line starting with `prefix`; fail with the output if it ends first."""
        while True:
            try:
                line = self._q.get(timeout=TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"no {prefix!r} line within {TIMEOUT_S} s:\n{self.output()}")
            if line is None:
                pytest.fail(f"exited before a {prefix!r} line:\n{self.output()}")
            if line.startswith(prefix):
                return line

    def finish(self):
        try:
            rc = self.p.wait(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.p.kill()
            pytest.fail(f"did not exit within {TIMEOUT_S} s:\n{self.output()}")
        return rc

    def result(self):
        line = next((l for l in self.lines if l.startswith("RESULT ")), None)
        assert line is not None, self.output()
        return json.loads(line[len("RESULT "):])

    def output(self):
        return "".join(self.lines)


@pytest.fixture
def start():
    """start(mode, processes, devices) -> [Proc]; anything still running at teardown is killed."""
    procs = []

    def _start(mode, processes=2, devices=2):
        port = free_port()
        new = [Proc([WORKER, mode], child_env(i, processes, devices, port)) for i in range(processes)]
        procs.extend(new)
        return new

    yield _start
    for p in procs:
        if p.p.poll() is None:
            p.p.kill()
            p.p.wait()


def test_collectives_broadcast_and_gather_across_processes(start):
    procs = start("collectives")
    for p in procs:
        assert p.finish() == 0, p.output()
    results = [p.result() for p in procs]
    for me, p in enumerate(procs):
        assert any(l.startswith(f"[p{me}/2] W") and "a tagged line" in l for l in p.lines), p.output()
    for me, r in enumerate(results):
        assert r["process"] == me and r["count"] == 2 and r["is_main"] == (me == 0)
        assert r["tag"] == f"[p{me}/2]"
        assert (r["devices"], r["local_devices"]) == (4, 2)
        assert r["total"] == 1 + 2 + 3 + 4  # device k holds k+1, summed over both processes
        assert r["gathered"] == [1, 11]  # process p contributes 10p + 1
        assert r["broadcast"] == {"run": "run-from-p0", "save": True}
        assert r["gather"] == ["p0", "p1"]


def test_C5_sigterm_on_one_process_stops_all_at_same_step_and_second_signal_is_ignored(start):
    procs = start("loop")
    for p in procs:
        p.wait_for("RUNNING")
    procs[1].p.send_signal(signal.SIGTERM)  # only process 1 is "preempted"
    for p in procs:
        p.wait_for("SAVING")
    for p in procs:  # a second signal mid-save must be noted, not kill the write
        p.p.send_signal(signal.SIGINT)
    for p in procs:
        assert p.finish() == 0, p.output()
    r0, r1 = (p.result() for p in procs)
    assert r0["stop_step"] == r1["stop_step"] >= 5
    assert r0["checksum"] == r1["checksum"]
    assert r0["reason"] == r1["reason"] == "SIGTERM on p1"
    assert r1["signals"] == ["SIGTERM", "SIGINT"] and r0["signals"] == ["SIGINT"]


def test_C5_single_process_uses_the_same_stop_signal(start):
    (p,) = start("loop", processes=1, devices=2)
    p.wait_for("RUNNING")
    p.p.send_signal(signal.SIGTERM)
    p.wait_for("SAVING")
    p.p.send_signal(signal.SIGINT)
    assert p.finish() == 0, p.output()
    r = p.result()
    assert r["stop_step"] >= 5 and r["reason"] == "SIGTERM on p0"
    assert r["signals"] == ["SIGTERM", "SIGINT"]


def test_C5_a_signal_whose_start_up_raise_was_lost_still_stops_the_run(start):
    (p,) = start("lost_raise", processes=1, devices=1)
    assert p.finish() == 0, p.output()
    assert "STILL RUNNING after ['SIGINT']" in p.output() and "Traceback" not in p.output()
    assert p.result() == {"first_call_stops": True, "reason": "SIGINT on p0"}


def test_a_signal_after_the_work_is_done_is_noted_and_a_second_one_raises(start):
    """A non-main process whose run is complete waits for process 0 (the summary): a
    preemption's SIGTERM there used to raise, exit 143 and report a failure that killed
    process 0 mid-write."""
    (p,) = start("finished", processes=1, devices=1)
    assert p.finish() == 0, p.output()
    assert "NOTED ['SIGTERM']" in p.output()
    assert p.result() == {"second_raised": True, "seen": ["SIGTERM", "SIGTERM"]}


def test_a_signal_while_the_interpreter_tears_down_leaves_the_exit_status_as_it_was(start):
    """Once a command's status is decided, a signal in its last half second (CPython puts
    the default action back midway) used to turn a stop that had saved and said so into
    exit 143; from the last exit handler on, signals are ignored."""
    (p,) = start("teardown", processes=1, devices=1)
    assert p.finish() == 0, p.output()
    assert p.result() == {"done": True} and "SURVIVED" in p.output(), p.output()


def _two_processes(tmp_path, extra, meanwhile=lambda procs: None):
    """Runs `train` in 2 processes (no launcher: as on a pod's hosts), process i with the
    flags extra[i], calling `meanwhile(procs)` once they started; -> (exit codes, outputs)."""
    port = free_port()
    cache = {"PPGD_TPU_CACHE": str(tmp_path / "cache")}  # the toy target is trained: seconds
    procs = [Proc(["-m", "ppgd_tpu.cli", "train", f"--run_dir={tmp_path / 'run'}",
                   "--log.progress=false", "--decomp.steps=20", *extra[i]],
                  {**child_env(i, 2, 1, port), **cache}) for i in range(2)]
    try:
        meanwhile(procs)
        codes = [p.finish() for p in procs]
    finally:
        for p in procs:
            if p.p.poll() is None:
                p.p.kill()
                p.p.wait()
    return codes, [p.output() for p in procs]


def test_a_process_that_ends_early_takes_the_others_with_it_naming_why(tmp_path):
    """SIGTERM to process 1 alone while the run is still building its target (before the
    loop, which would save and stop cleanly): it exits 143 saying so, and process 0, which
    would wait in its next collective for a process that is gone (300 s, then JAX's abort),
    exits at once naming process 1's reason, with its status: stopped, not failed (it
    exited 1). No launcher: each host of a pod is alone."""
    def terminate_p1_before_the_loop(procs):
        deadline = time.monotonic() + TIMEOUT_S
        while not any("mesh {" in line for line in procs[1].lines):
            assert time.monotonic() < deadline and procs[1].p.poll() is None, procs[1].output()
            time.sleep(0.05)
        procs[1].p.send_signal(signal.SIGTERM)

    codes, outs = _two_processes(tmp_path, [[], []], terminate_p1_before_the_loop)
    assert codes == [143, 143], [out[-3000:] for out in outs]
    assert "ppgd-tpu: terminated (SIGTERM); nothing partial is read as complete" in outs[1]
    assert ("[p0/2] stopping: process 1: ppgd-tpu: terminated (SIGTERM)" in outs[0]
            and "Traceback" not in outs[0]), outs[0][-3000:]


def test_a_refusal_one_process_alone_sees_ends_every_process_as_a_refusal(tmp_path):
    """Process 1's --target.path names no file (each host reads its own path): it is
    refused, and process 0, which would wait for it in a collective (300 s, then JAX's
    abort), exits 2 at once naming process 1's reason."""
    codes, outs = _two_processes(tmp_path, [[], [f"--target.path={tmp_path / 'nope'}"]])
    assert codes == [2, 2], outs
    why = f"ppgd-tpu train: error: target.path: no such file '{tmp_path / 'nope'}'"
    assert why in outs[1], outs[1][-3000:]
    assert f"[p0/2] stopping: process 1: {why}" in outs[0], outs[0][-3000:]
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_processes_given_different_configs_are_refused_naming_the_fields(tmp_path):
    """A stale --config on one host: the job would train each host's shards on its own
    rules and record process 0's config, silently."""
    codes, outs = _two_processes(tmp_path, [[], ["--decomp.lr_components.value=0.01"]])
    assert codes == [2, 2], outs
    for out in outs:
        assert "the processes of this job were given different configs" in out, out[-3000:]
        assert "decomp.lr_components.value: 0.001 in process 0, 0.01 in process 1" in out
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_unreachable_coordinator_is_a_clear_error_not_a_hang():
    with socket.socket() as held:  # bound, not listening: nobody answers, nobody takes it
        held.bind(("127.0.0.1", free_port()))
        port = held.getsockname()[1]
        code = ("from ppgd_tpu import dist\n"
                f"dist.initialize('127.0.0.1:{port}', 2, 1, local_device_count=1, timeout_s=2)\n")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                     "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 1, out.stderr
    assert f"coordinator 127.0.0.1:{port} did not answer within 2 s" in out.stderr


@pytest.mark.parametrize("env, message", [
    ({dist.ENV_NUM_PROCESSES: "two"}, "PPGD_NUM_PROCESSES='two': expected an integer >= 1"),
    ({dist.ENV_NUM_PROCESSES: "2", dist.ENV_PROCESS_ID: "0"}, "missing: PPGD_COORDINATOR_ADDRESS"),
    ({dist.ENV_COORDINATOR_ADDRESS: "localhost", dist.ENV_NUM_PROCESSES: "2",
      dist.ENV_PROCESS_ID: "1"}, "expected HOST:PORT"),
    ({dist.ENV_COORDINATOR_ADDRESS: "h:1", dist.ENV_NUM_PROCESSES: "2",
      dist.ENV_PROCESS_ID: "2"}, "expected 0 <= id < PPGD_NUM_PROCESSES=2"),
    ({dist.ENV_LOCAL_DEVICE_COUNT: "0"}, "PPGD_LOCAL_DEVICE_COUNT=0: expected an integer >= 1"),
])
def test_bad_settings_are_refused_naming_the_variable(monkeypatch, env, message):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match=re.escape(message)):
        dist.resolve_settings()


def test_settings_arguments_win_over_environment(monkeypatch):
    monkeypatch.setenv(dist.ENV_NUM_PROCESSES, "4")
    monkeypatch.setenv(dist.ENV_COORDINATOR_ADDRESS, "h:1")
    monkeypatch.setenv(dist.ENV_PROCESS_ID, "3")
    assert dist.resolve_settings(process_id=1) == dist.Settings("h:1", 4, 1, None)
    assert dist.resolve_settings(num_processes=1, process_id=0).num_processes == 1


def test_initialize_is_idempotent_and_guards_its_preconditions():
    code = """
from ppgd_tpu import dist
try:
    dist.StopSignal()
except RuntimeError as e:
    print("ERR1", e)
first = dist.initialize()
assert dist.initialize() is first and first == dist.Settings(None, 1, 0, None)
try:
    dist.initialize(local_device_count=2)
except RuntimeError as e:
    print("ERR2", e)
with dist.StopSignal() as stop:
    assert [stop.should_stop(s) for s in range(3)] == [False] * 3
    try:
        dist.StopSignal()
    except RuntimeError as e:
        print("ERR3", e)
print("OK", dist.process_index(), dist.process_count(), dist.is_main(), repr(dist.tag()),
      dist.broadcast_from_main({"a": [1]}), dist.gather_from_all(3))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(ROOT),
                                                 "JAX_PLATFORMS": "cpu"})
    assert out.returncode == 0, out.stderr
    assert "ERR1 call dist.initialize() before StopSignal()" in out.stdout
    assert "ERR2 dist.initialize() already ran with" in out.stdout
    assert "ERR3 StopSignal is already installed" in out.stdout
    assert "OK 0 1 True '' {'a': [1]} [3]" in out.stdout


def test_tpu_coordinator_port_from_the_pod_script_reaches_jax(monkeypatch):
    """launch/tpu_pod.sh exports PPGD_COORDINATOR_PORT; JAX's TPU detection reads
    JAX_COORDINATOR_PORT."""
    from ppgd_tpu import dist as dist_lib

    monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)
    monkeypatch.setenv("PPGD_COORDINATOR_PORT", "8476")
    dist_lib._export_tpu_coordinator_port()
    assert os.environ["JAX_COORDINATOR_PORT"] == "8476"
    monkeypatch.setenv("PPGD_COORDINATOR_PORT", "http")
    with pytest.raises(ValueError, match="PPGD_COORDINATOR_PORT='http'"):
        dist_lib._export_tpu_coordinator_port()
