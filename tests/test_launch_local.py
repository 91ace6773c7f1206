"""The local N-process launcher (`ppgd-tpu launch-local`, launch/local.sh) with real children."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import run_command

from ppgd_tpu import checkpoint, launch_local

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 60
ARGS = ["train", "--name=a b", "--note", "x = y", "", "--flag=--not-a-launcher-flag"]


def run(cmd, **env):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def echoes(stdout):
    """{process index: echoed payload} from the `[pN] ECHO {...}` lines."""
    out = {}
    for line in stdout.splitlines():
        prefix, _, rest = line.partition(" ")
        if rest.startswith("ECHO "):
            out[int(prefix[2:-1])] = json.loads(rest[len("ECHO "):])
    return out


def check_echoes(stdout, processes, devices):
    got = echoes(stdout)
    assert sorted(got) == list(range(processes)), stdout
    port = got[0]["env"]["PPGD_COORDINATOR_ADDRESS"]
    for i, e in got.items():
        assert e["argv"] == ARGS
        assert e["env"] == {"PPGD_COORDINATOR_ADDRESS": port, "PPGD_NUM_PROCESSES": str(processes),
                            "PPGD_PROCESS_ID": str(i), "PPGD_LOCAL_DEVICE_COUNT": str(devices)}



def test_free_port_is_below_the_ephemeral_range_and_unseeded():
    """The coordinator binds the port seconds after free_port() chose it: one from the
    ephemeral range could meanwhile be handed to any connect() or bind(0) on the machine
    (the other pytest worker's gloo, its emulator); a seeded `random` would give two
    launchers the same port."""
    import random
    import socket

    low = launch_local._ephemeral_low()
    ports = []
    for _ in range(20):
        random.seed(0)
        port = launch_local.free_port()
        assert 10000 <= port < low, (port, low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free when returned
        ports.append(port)
    assert len(set(ports)) > 1, ports

def test_args_after_double_dash_reach_every_child_unchanged_with_module():
    out = run([sys.executable, "-m", "ppgd_tpu", "launch-local", "--processes", "3",
               "--devices_per_process", "2", "--module", "tests.dist_echo", "--", *ARGS])
    assert out.returncode == 0, out.stdout + out.stderr
    check_echoes(out.stdout, 3, 2)
    tagged = sorted(ln for ln in out.stdout.splitlines() if "tagged as dist.tag()" in ln)
    assert [ln.split()[0] for ln in tagged] == ["[p0/3]", "[p1/3]", "[p2/3]"]  # not doubled


def test_shell_wrapper_passes_flags_and_args_through():
    out = run(["bash", str(ROOT / "launch" / "local.sh"), "2", "1", "--exec", "--",
               sys.executable, str(ROOT / "tests" / "dist_echo.py"), *ARGS], PYTHON=sys.executable)
    assert out.returncode == 0, out.stdout + out.stderr
    check_echoes(out.stdout, 2, 1)


def test_fail_fast_kills_the_others_and_names_the_failing_child(tmp_path):
    out = run([sys.executable, "-m", "ppgd_tpu", "launch-local", "--processes", "2", "--exec", "--",
               sys.executable, str(ROOT / "tests" / "dist_echo.py")],
              DIST_ECHO_MODE="fail", DIST_ECHO_DIR=str(tmp_path))
    assert out.returncode == 3, out.stdout + out.stderr
    assert "process p1 exited with code 3" in out.stderr
    assert "[p1] failing now" in out.stdout
    assert "ending the others (killed if still running after" in out.stderr
    with pytest.raises(ProcessLookupError):  # p0 was killed (and reaped) before we returned
        os.kill(int((tmp_path / "p0.pid").read_text()), 0)


def test_the_others_end_on_their_own_before_being_killed(tmp_path):
    """A child told of another's failure says so and exits (a ppgd-tpu child: within
    dist.FAILURE_GRACE_S, by dist.report_failure); killed at once with the first failure,
    it could not say it (a refusal every process sees was then said by only some)."""
    out = run([sys.executable, "-m", "ppgd_tpu", "launch-local", "--processes", "2", "--exec", "--",
               sys.executable, str(ROOT / "tests" / "dist_echo.py")],
              DIST_ECHO_MODE="fail_told", DIST_ECHO_DIR=str(tmp_path))
    assert out.returncode == 3, out.stdout + out.stderr
    assert "process p1 exited with code 3" in out.stderr
    assert "[p0] told of p1's failure, ending" in out.stdout, out.stdout + out.stderr


def test_C5_signals_to_the_launcher_reach_all_children_which_stop_at_one_step():
    p = subprocess.Popen(
        [sys.executable, "-m", "ppgd_tpu", "launch-local", "--processes", "2",
         "--devices_per_process", "2", "--exec", "--", sys.executable,
         str(ROOT / "tests" / "dist_worker.py"), "loop"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        def wait_for_both(word):
            seen = set()
            for line in p.stdout:
                lines.append(line)
                if line.split(" ")[1:2] == [word]:
                    seen.add(line[:4])
                if len(seen) == 2:
                    return
            pytest.fail(f"launcher output ended before both children said {word}:\n{''.join(lines)}")

        wait_for_both("RUNNING")
        p.send_signal(signal.SIGTERM)  # forwarded to both children: stop
        wait_for_both("SAVING")
        p.send_signal(signal.SIGINT)  # a second Ctrl-C to the launcher: not forwarded ...
        for child in _children_of(p.pid):  # ... and one straight to a child mid-save: noted
            os.kill(child, signal.SIGINT)
        lines.extend(p.stdout)
        assert p.wait(timeout=TIMEOUT_S) == 0, "".join(lines)
        assert "SIGTERM was forwarded already" in "".join(lines)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    results = [json.loads(l.split("RESULT ", 1)[1]) for l in lines if " RESULT " in l]
    assert len(results) == 2, "".join(lines)
    assert results[0]["stop_step"] == results[1]["stop_step"] >= 5
    assert results[0]["checksum"] == results[1]["checksum"]
    assert all(r["signals"] == ["SIGTERM", "SIGINT"] for r in results)


def test_a_signal_before_the_loop_ends_the_job_as_stopped_not_as_a_failure(tmp_path):
    """Ctrl-C to the launcher while the children build the run (before the loop, which
    would save): every child exits 130, and so does the launcher, saying the signal
    stopped the job (it exited 1 naming p1 as a failure: p0 told p1 to exit 1)."""
    p = subprocess.Popen(
        [sys.executable, "-m", "ppgd_tpu", "launch-local", "--processes", "2", "--", "train",
         f"--run_dir={tmp_path / 'run'}", "--decomp.steps=100", "--log.progress=false"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if "mesh {" in line:  # (logged before the target is built)
                p.send_signal(signal.SIGINT)
                break
        lines.extend(p.stdout)
        assert p.wait(timeout=TIMEOUT_S) == 130, "".join(lines)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    out = "".join(lines)
    assert ("the SIGINT stopped the job before its loop (nothing saved) or after its last "
            "step (its checkpoint committed); exit 130") in out, out
    assert "ending the others" not in out and "exited with code 1" not in out


def _children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_C5_children_of_a_launcher_that_dies_stop_and_save(tmp_path):
    """SIGKILL to the launcher (or its terminal gone): its children are told with SIGTERM,
    agree on a step, save it and exit, instead of running on orphaned until a collective
    times out (the run dir's lock released, so a second command could start beside them)."""
    run = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, "-m", "ppgd_tpu", "launch-local", "--processes", "2", "--", "train",
         f"--run_dir={run}", "--decomp.steps=200000", "--log.every=50", "--eval.every=0",
         "--log.progress=false", "--checkpoint.every=0"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    children = []
    try:
        deadline = time.monotonic() + 4 * TIMEOUT_S
        while not (run / "metrics.jsonl").exists():  # both are in the loop
            assert time.monotonic() < deadline and p.poll() is None
            time.sleep(0.2)
        children = _children_of(p.pid)
        assert len(children) == 2
        p.kill()
        p.wait()
        deadline = time.monotonic() + TIMEOUT_S
        while any(Path(f"/proc/{c}").exists() for c in children):
            assert time.monotonic() < deadline, "the children ran on"
            time.sleep(0.2)
    finally:
        for c in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(c, signal.SIGKILL)
    step = checkpoint.latest_step(str(run))  # the stop's save: periodic ones are off
    assert step is not None and 0 < step < 200000 and not (run / "summary.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--processes", "0"], "--processes='0': use a whole number >= 1"),
    (["--processes", "2", "--devices_per_process", "0"],
     "--devices_per_process='0': use a whole number >= 1"),
    (["--processes", "2", "--port", "70000"], "--port='70000': use a whole number from 0 to 65535"),
    ([], "--processes: required (number of processes)"),
    (["--processes", "2", "--exec"], "no command after --"),
    (["--processes", "2"], "no command after --"),  # ran 2 children that printed the usage
    (["--processes", "2", "train", "--config", "x.yaml"],
     "--config: unknown flag (see --helpfull); the command goes after `--`"),
    (["--processes", "2", "train"], "unrecognized arguments: train (the command goes after `--`"),
    (["--processes", "1", "--exec", "--", "/nonexistent/x"],  # a FileNotFoundError traceback
     "--exec: '/nonexistent/x' is not an executable file or on PATH"),
])
def test_bad_launcher_flags_are_refused_naming_the_flag(capsys, argv, message):
    rc, out, err = run_command(["launch-local", *argv], capsys)
    assert rc == 2 and message in err and not out


def test_a_refusal_every_process_sees_is_said_once_by_each(tmp_path):
    """A batch that does not divide over 3 processes: each one says the refusal (exit 2,
    the field named) once: its own line, or, when another refused first, that one's
    notice ("stopping: process 0: ..."), not its own line followed by the notice too."""
    out = subprocess.run([sys.executable, "-m", "ppgd_tpu", "launch-local", "--processes", "3",
                          "--", "train", f"--run_dir={tmp_path / 'r'}", "--data.batch_size=32",
                          "--eval.batch_size=30", "--log.progress=false"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    for i in range(3):
        mine = [ln for ln in text.splitlines() if ln.startswith(f"[p{i}")]
        said = [ln for ln in mine if "data.batch_size: 32 rows do not divide" in ln]
        assert len(said) == 1, f"p{i}:\n" + "\n".join(mine)
    assert not (tmp_path / "r").exists()
