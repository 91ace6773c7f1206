"""`ppgd-tpu launch-local`: run N local processes as one multi-process JAX job.

    ppgd-tpu launch-local --processes 2 --devices_per_process 2 -- train --config x.yaml

Each child runs `python -m ppgd_tpu.cli <args after -->` (or `--module M`, or the argv
after `--` as-is with `--exec`) with the PPGD_* variables that `ppgd_tpu.dist.initialize`
reads, on a free localhost port. This is how multi-host behaviour (gloo collectives,
stop-signal consensus [C5], per-process checkpoint writes) runs on one machine.

Output is streamed line by line with a `[pN]` prefix (none on lines the child tagged
`[pN/M]` itself). Fail-fast: the first child that exits non-zero is named with its exit
code, and its code is ours (a child killed by signal S counts as 128+S); the others, told
of it, get OTHERS_END_S to say so and exit, and are then killed. The first SIGTERM/SIGINT
sent to the launcher is forwarded to every child (SIGHUP, a closed terminal, as SIGTERM);
the children agree on a stop step, save, and exit 0; later signals are only noted, so
pressing Ctrl-C again cannot turn that clean stop into a failure. Children run in their own
process groups so a terminal's Ctrl-C reaches them only through this forwarding, and
(children of `python -m MODULE`, on Linux) get a SIGTERM if the launcher itself dies
(signals.follow_launcher). JAX_PLATFORMS defaults to cpu for the children.
"""

from __future__ import annotations

import contextlib
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO

from ppgd_tpu import cmdline, dist, signals


def free_port() -> int:
    """A localhost TCP port nobody holds right now, below the kernel's ephemeral range.

    The coordinator binds it seconds later, once a child has imported JAX. A port of the
    ephemeral range may be handed to any connect() or bind(0) on the machine in between
    (another job's collectives, or its own free_port); one below it is only taken by a
    process that names it. Drawn by the OS's randomness: a seeded `random` would give two
    launchers the same port."""
    low, draw = _ephemeral_low(), random.SystemRandom()
    for _ in range(100 if low > 10000 else 0):
        port = draw.randrange(10000, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # held, or lingering in TIME_WAIT
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    """The first port of Linux's ephemeral range (32768 where it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def child_env(index: int, processes: int, devices_per_process: int, port: int,
              base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of child `index`: what `dist.initialize()` reads."""
    env = dict(os.environ if base is None else base)
    env.update({
        dist.ENV_COORDINATOR_ADDRESS: f"127.0.0.1:{port}",
        dist.ENV_NUM_PROCESSES: str(processes),
        dist.ENV_PROCESS_ID: str(index),
        dist.ENV_LOCAL_DEVICE_COUNT: str(devices_per_process),
        "PYTHONUNBUFFERED": "1",
    })
    env.setdefault("JAX_PLATFORMS", "cpu")
    return env


USAGE = ("usage: ppgd-tpu launch-local --processes N [flags] -- COMMAND [ARGS]\n\n"
         "Run N local processes as one multi-process JAX job; the args after -- go to each "
         "child.")


def _parse(argv: list[str]) -> tuple[dict, list[str]]:
    """-> ({flag: value}, the child's argv); a bad command line raises UsageError."""
    own, child = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    after = "the command goes after `--`: ppgd-tpu launch-local --processes N -- train ..."
    try:
        args, stray = cmdline.parse_flags(own, {
            "processes": (None, "number of processes", cmdline.count),
            "devices_per_process": ("1", "CPU devices per process", cmdline.count),
            "port": ("0", "coordinator port (0: a free one)", cmdline.integer(0, 65535)),
            "module": ("ppgd_tpu.cli", "child runs `python -m MODULE ARGS`"),
            "exec": (False, "run the argv after -- as-is instead of `python -m MODULE`")},
            USAGE)
    except cmdline.UsageError as e:  # a command's flag before any `--`
        raise cmdline.UsageError(f"{e}; {after}" if not child else str(e)) from None
    if stray:
        raise cmdline.UsageError(f"unrecognized arguments: {' '.join(stray)} ({after})")
    if not child:
        raise cmdline.UsageError(
            "no command after --: each process runs `ppgd-tpu <command> ...` (or, with "
            "--exec, the argv) given there, e.g. -- train --config configs/tms_5-2.yaml")
    if args["exec"] and shutil.which(child[0]) is None:
        raise cmdline.UsageError(f"--exec: {child[0]!r} is not an executable file or on PATH")
    return args, child


def _pump(index: int, stream: IO[bytes], out_lock: threading.Lock) -> None:
    """The child's lines, each prefixed `[pN] ` but those it tagged itself (`[pN/M]`,
    dist.tag()): they say which process already."""
    prefix, tagged = f"[p{index}] ".encode(), f"[p{index}/".encode()
    out = sys.stdout.buffer
    for line in iter(stream.readline, b""):
        line = line if line.endswith(b"\n") else line + b"\n"
        with out_lock:
            out.write(line if line.startswith(tagged) else prefix + line)
            out.flush()
    stream.close()


def _say(msg: str) -> None:
    print(f"launch-local: {msg}", file=sys.stderr, flush=True)


def _kill(child: subprocess.Popen) -> None:
    if child.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)


def _exit_code(returncode: int) -> int:
    return returncode if returncode >= 0 else 128 - returncode


def main(argv: list[str]) -> int:
    """Run the job; 0 when every child succeeds, else the first failing child's code."""
    args, child_args = _parse(argv)
    port = args["port"] or free_port()
    cmd = child_args if args["exec"] else [sys.executable, "-m", args["module"], *child_args]
    _say(f"{args['processes']} processes x {args['devices_per_process']} devices, "
         f"coordinator 127.0.0.1:{port}: {' '.join(cmd)}")
    out_lock = threading.Lock()
    children: list[subprocess.Popen] = []
    pumps: list[threading.Thread] = []
    exits: queue.Queue[tuple[int, int]] = queue.Queue()  # (index, returncode) in exit order

    forwarded: list[str] = []

    def forward(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if forwarded:
            groups = " ".join(f"-{c.pid}" for c in children if c.poll() is None)
            _say(f"got {name}; {forwarded[0]} was forwarded already: the children are "
                 f"stopping (to end them at once, unsaved: kill -KILL -- {groups})")
            return
        forwarded.append(name)
        as_ = signal.SIGTERM if signum == signal.SIGHUP else signum
        _say(f"got {name}; forwarding {signal.Signals(as_).name} to the children")
        for c in children:
            if c.poll() is None:
                c.send_signal(as_)

    previous = {s: signal.signal(s, forward)
                for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    try:
        for i in range(args["processes"]):
            env = child_env(i, args["processes"], args["devices_per_process"], port)
            # A program given as-is (--exec) may start ours as a grandchild, whose parent
            # is then not this launcher: only `python -m MODULE` children follow it.
            if not args["exec"]:
                env[signals.LAUNCHER_PID] = str(os.getpid())
            c = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, process_group=0)
            children.append(c)
            t = threading.Thread(target=_pump, args=(i, c.stdout, out_lock), daemon=True)
            t.start()
            pumps.append(t)
            threading.Thread(target=lambda i=i, c=c: exits.put((i, c.wait())), daemon=True).start()
        code = _wait(children, exits, forwarded)
    finally:
        for c in children:
            _kill(c)
            c.wait()
        for t in pumps:
            t.join(timeout=5)
        for s, h in previous.items():
            signal.signal(s, h)
    return code


# After the first failure, how long the other children get to end on their own before they
# are killed: a ppgd-tpu child is told of it (dist.report_failure), says why and exits within
# dist.FAILURE_GRACE_S; killed at once, it could not say why.
OTHERS_END_S = dist.FAILURE_GRACE_S + 3.0


def _wait(children: list[subprocess.Popen], exits: queue.Queue[tuple[int, int]],
          forwarded: list[str]) -> int:
    """Block until every child exits 0, or until the first failure (then end the rest). A
    child that ends with 130/143 after a forwarded signal was stopped by it, before its
    loop or after its last step (every child ends so), not failed."""
    for _ in children:
        while True:
            try:  # a timeout keeps the main thread responsive to forwarded signals
                index, rc = exits.get(timeout=0.5)
                break
            except queue.Empty:
                continue
        if rc != 0:
            how = (f"was killed by signal {-rc} ({_exit_code(rc)})" if rc < 0
                   else f"exited with code {rc}")
            if forwarded and rc in (130, 143):
                _say(f"the {forwarded[0]} stopped the job before its loop (nothing saved) or "
                     f"after its last step (its checkpoint committed); exit {rc}. Re-run the "
                     "same command to start, resume or finish it")
            else:
                _say(f"process p{index} {how}; ending the others (killed if still running "
                     f"after {OTHERS_END_S:g} s)")
            deadline = time.monotonic() + OTHERS_END_S
            while any(c.poll() is None for c in children) and time.monotonic() < deadline:
                time.sleep(0.05)
            for c in children:
                _kill(c)
            return _exit_code(rc)
    return 0
