"""Stand-ins for programs on a TPU worker, run by the fake gcloud: record, never harm.

Called as `remote_stub.py NAME ARGS...` with HOME=STATE/worker-I/home, FAKE_TPU_WORKER=I.
Each call appends {"worker", "prog", "argv", "env" (PPGD_*, LIBTPU_*, XLA_*), "pid"}
to STATE/remote.jsonl; `ppgd-tpu` appends a second record with "exit" when it returns.
  sudo pkill ...   marks this worker's training as stopped (STATE/worker-I/stop)
  sudo ...         anything else: recorded only (lsof finds nothing)
  pgrep            finds nothing
  python3 -m pip install --user ... uv    puts a `uv` stub in HOME/.local/bin
  uv venv ... DIR                         makes DIR/bin/python, this stub's python3
  python3 -m pip install|show ppgd-tpu   records the install, reports its version
  ppgd-tpu train   behaves as the scenario's "train" entry for this run and worker says
"""
import json
import os
import re
import sys
import time
from pathlib import Path

STATE = Path(os.environ["FAKE_GCLOUD_STATE"])
WORKER = int(os.environ["FAKE_TPU_WORKER"])
WDIR = STATE / f"worker-{WORKER}"


def record(prog, argv, **extra):
    env = {k: v for k, v in os.environ.items() if k.startswith(("PPGD_", "LIBTPU_", "XLA_"))}
    line = json.dumps({"worker": WORKER, "prog": prog, "argv": argv, "env": env, "pid": os.getpid(), **extra})
    with open(STATE / "remote.jsonl", "a") as f:
        f.write(line + "\n")


def scenario():
    path = os.environ.get("FAKE_GCLOUD_SCENARIO")
    return json.loads(Path(path).read_text()) if path else {}


def sudo(argv):
    if argv[:1] == ["pkill"]:
        (WDIR / "stop").touch()
    return 1 if argv[:1] == ["lsof"] else 0


def stub(path, name):
    """An executable at `path` that runs this stub as `name`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{Path(__file__).resolve()}" {name} "$@"\n')
    path.chmod(0o755)


def uv(argv):
    if argv[:1] != ["venv"] or "--python" not in argv:
        print(f"remote_stub uv: unsupported {argv}", file=sys.stderr)
        return 2
    stub(Path(argv[-1]) / "bin" / "python", "python3")
    (WDIR / "installed").unlink(missing_ok=True)  # --clear: a fresh venv
    return 0


def python3(argv):
    if argv[:3] == ["-m", "pip", "install"] and argv[-1] == "uv":
        stub(Path(os.environ["HOME"]) / ".local" / "bin" / "uv", "uv")
        return 0
    if argv[:3] == ["-m", "pip", "install"]:
        spec = argv[-1]
        m = re.search(r"ppgd_tpu-([^-]+?)(-py3.*\.whl|\.tar\.gz)", spec)
        (WDIR / "installed").write_text(m.group(1) if m else "0.1.0")
        return 0
    if argv[:4] == ["-m", "pip", "show", "ppgd-tpu"]:
        if not (WDIR / "installed").exists():
            print("WARNING: Package(s) not found: ppgd-tpu", file=sys.stderr)
            return 1
        v = scenario().get("versions", {}).get(str(WORKER), (WDIR / "installed").read_text())
        print(f"Name: ppgd-tpu\nVersion: {v}\nSummary: fake")
        return 0
    print(f"remote_stub python3: unsupported {argv}", file=sys.stderr)
    return 2


def preempt():
    import fcntl
    with open(STATE / "pod.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pod = json.loads((STATE / "pod.json").read_text())
        pod["state"] = "PREEMPTED"
        if pod.get("queued"):
            pod["queued"] = "SUSPENDED"
        (STATE / "pod.json").write_text(json.dumps(pod))


def ppgd_tpu(argv):
    runs = WDIR / "train_runs"
    n = int(runs.read_text()) + 1 if runs.exists() else 1
    runs.write_text(str(n))
    (WDIR / "stop").unlink(missing_ok=True)
    plan = scenario().get("train", {}).get(str(n), {})
    action = plan.get(str(WORKER), plan.get("*", "ok"))
    print(f"fake train run {n} on worker {WORKER}: {action}", flush=True)
    if action in ("ok", "stopped"):  # stopped: a SIGTERM's save-and-exit, no summary
        if action == "ok" and WORKER == 0 and "--run_dir" in argv:  # process 0 finishes
            summary = STATE / "gcs" / argv[argv.index("--run_dir") + 1].removeprefix("gs://")
            summary.mkdir(parents=True, exist_ok=True)
            (summary / "summary.json").write_text("{}")
        return 0
    if action == "preempt":
        preempt()
        return 255
    if action == "commit+preempt":  # trains far enough to commit checkpoint 10 n, then is lost
        run_dir = argv[argv.index("--run_dir") + 1].removeprefix("gs://")
        marker = STATE / "gcs" / run_dir / "ckpts" / str(10 * n) / "COMMITTED"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        preempt()
        return 255
    if action == "slow":  # trains a while, writing to its console (no run dir needed)
        for i in range(15):
            print(f"fake train step {i}", flush=True)
            time.sleep(0.1)
        print("fake train done", flush=True)
        return 0
    if action == "block":
        for _ in range(2400):  # a safety net: a launcher that never stops us fails the test
            if (WDIR / "stop").exists():
                return 143
            time.sleep(0.05)
        return 99
    return int(action["exit"])


def main():
    prog, argv = sys.argv[1], sys.argv[2:]
    record(prog, argv)
    run = {"sudo": sudo, "pgrep": lambda _: 1, "python3": python3, "uv": uv,
           "ppgd-tpu": ppgd_tpu}[prog]
    code = run(argv)
    if prog == "ppgd-tpu":  # a stub killed by a signal records no exit
        record(prog, argv, exit=code)
    return code


if __name__ == "__main__":
    sys.exit(main())
