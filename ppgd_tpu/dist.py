"""Process bring-up, cross-process agreement, and stop-signal consensus [C5].

The one module that touches `jax.distributed` and JAX's coordination service. Everything
else asks it: which process am I (`is_main`, `tag`), wait for everyone (`barrier`), tell
everyone (`broadcast_from_main`), what has each (`gather_from_all`), and should the loop
stop now (`StopSignal.should_stop`).

Bring-up. `initialize()` takes its settings from arguments or the PPGD_* environment
(set by `ppgd_tpu.launch_local` or a pod script). With nothing set it auto-detects on a
Cloud TPU VM (`jax.distributed.initialize()`) and stays single-process elsewhere. On CPU
it selects gloo collectives and the local device count before the backend starts, which
is how multi-host behaviour is tested on one machine. JAX aborts the whole process when
the coordinator never answers, so a non-coordinator process first probes the
coordinator's TCP port and raises an error naming the address and the timeout.

Agreement helpers use the coordination service's key-value store, not device
collectives: the values are small host-side JSON (a run directory, a save decision),
and they must work before any mesh exists. Like collectives, every process must call
them in the same order (keys are numbered per call).

Stop signal: ONE mechanism, chosen deliberately. JAX's preemption sync manager
(`multihost_utils.reached_preemption_sync_point`) installs a C++ SIGTERM handler at
`jax.distributed.initialize`; any later Python `signal.signal(SIGTERM, ...)` silently
replaces it, and vice versa. We do not use it because it only knows SIGTERM (not Ctrl-C),
does nothing in a single-process run (no client: always False), and gives no control over
a second signal arriving during the save. Instead `initialize` disables JAX's preemption
service, and `StopSignal` owns SIGTERM and SIGINT in every process:

1. The Python handler only sets a flag (no I/O, no locks). Later signals are noted and
   ignored until `close()`, so a second signal during the save cannot kill a write.
2. A local request is announced through the key-value store; a watcher thread in every
   process sees the announcement (any process's) and publishes a proposal: the next
   `should_stop` call of its main thread (or the current one, if the main thread got
   there first). The main thread never goes past its own proposal before the decision.
3. The decision is the maximum proposal, the same number in every process; each one's
   `should_stop` returns True exactly at that call. Because proposals come from the
   watcher thread, a main thread blocked in a collective cannot deadlock the protocol.

The fast path of `should_stop` is a counter increment and a flag check under an
uncontended lock: no device sync, no RPC. Calls are counted, not step numbers, so the
loop may number steps however it likes as long as every process calls `should_stop` the
same number of times (it runs the same program). A single-process run uses the same
object: the decision is simply the first boundary after the signal.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging as std_logging
import os
import signal
import socket
import threading
import time
from typing import Any

import jax
from absl import logging

from ppgd_tpu import signals as startup_signals

ENV_COORDINATOR_ADDRESS = "PPGD_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "PPGD_NUM_PROCESSES"
ENV_PROCESS_ID = "PPGD_PROCESS_ID"
ENV_LOCAL_DEVICE_COUNT = "PPGD_LOCAL_DEVICE_COUNT"

DEFAULT_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Settings:
    """Resolved bring-up settings; `coordinator_address is None` means single-process
    (or TPU auto-detect)."""

    coordinator_address: str | None
    num_processes: int
    process_id: int
    local_device_count: int | None


@dataclasses.dataclass
class _State:
    index: int = 0
    count: int = 1
    client: Any = None  # jax coordination-service client; None when single-process
    requested: Settings | None = None  # what initialize() resolved; None before it ran
    settings: Settings | None = None  # what it brought up (index/count from JAX)
    seq: dict[str, int] = dataclasses.field(default_factory=dict)
    failure_watcher: threading.Thread | None = None  # multi-process: _watch_failures
    said_end: bool = False  # why this process ends was said (claim_saying_end)


_state = _State()


# ----------------------------------------------------------------------------- bring-up


def _env_int(name: str, value: int | None, minimum: int) -> int | None:
    if value is None:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return None
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected an integer >= {minimum}") from None
    if not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected an integer >= {minimum}")
    return value


def resolve_settings(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_count: int | None = None,
) -> Settings:
    """Arguments win over PPGD_* environment variables; a partial multi-process setting is
    refused naming what is missing."""
    address = coordinator_address or os.environ.get(ENV_COORDINATOR_ADDRESS) or None
    count = _env_int(ENV_NUM_PROCESSES, num_processes, 1)
    pid = _env_int(ENV_PROCESS_ID, process_id, 0)
    devices = _env_int(ENV_LOCAL_DEVICE_COUNT, local_device_count, 1)
    given = {ENV_COORDINATOR_ADDRESS: address, ENV_NUM_PROCESSES: count, ENV_PROCESS_ID: pid}
    if any(v is not None for v in given.values()) and (count or 1) > 1:
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(
                f"multi-process bring-up needs {', '.join(given)}; missing: {', '.join(missing)}"
            )
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{ENV_COORDINATOR_ADDRESS}={address!r}: expected HOST:PORT")
        if pid >= count:
            raise ValueError(f"{ENV_PROCESS_ID}={pid}: expected 0 <= id < {ENV_NUM_PROCESSES}={count}")
        return Settings(address, count, pid, devices)
    if pid not in (None, 0):
        raise ValueError(f"{ENV_PROCESS_ID}={pid} but {ENV_NUM_PROCESSES} is {count or 1}")
    return Settings(None, 1, 0, devices)


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
    """JAX aborts the process (no exception) when the coordinator never answers; probe
    its port first so the failure is a readable error instead."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"coordinator {address} did not answer within {timeout_s:g} s "
                    f"({type(e).__name__}: {e}); is process 0 running and is "
                    f"{ENV_COORDINATOR_ADDRESS} right?"
                ) from None
            time.sleep(0.2)


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_count: int | None = None,
    timeout_s: int = DEFAULT_TIMEOUT_S,
) -> Settings:
    """Bring up this process, before any JAX computation. Calling it again with the same
    settings returns them (tests, re-entrant entry points); different settings are refused."""
    settings = resolve_settings(coordinator_address, num_processes, process_id, local_device_count)
    if _state.requested is not None:
        if settings == _state.requested:
            return _state.settings
        raise RuntimeError(
            f"dist.initialize() already ran with {_state.requested}; refusing {settings}"
        )
    from jax._src import xla_bridge  # backend state: config below only works before it starts

    if xla_bridge.backends_are_initialized() and (
        settings.coordinator_address is not None or settings.local_device_count is not None
    ):
        raise RuntimeError(
            "dist.initialize() must run before any JAX computation when it sets "
            f"{ENV_COORDINATOR_ADDRESS} or {ENV_LOCAL_DEVICE_COUNT} (the backend is already up)"
        )
    # We own SIGTERM (module docstring): JAX's notifier would fight our handler.
    jax.config.update("jax_enable_preemption_service", False)
    if settings.local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", settings.local_device_count)
    if settings.coordinator_address is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        if settings.process_id != 0:
            _wait_for_coordinator(settings.coordinator_address, timeout_s)
        logging.info(
            "connecting to coordinator %s as process %d/%d (timeout %d s)",
            settings.coordinator_address, settings.process_id, settings.num_processes, timeout_s,
        )
        jax.distributed.initialize(
            settings.coordinator_address,
            settings.num_processes,
            settings.process_id,
            initialization_timeout=timeout_s,
            cluster_detection_method="deactivate",
        )
    elif _on_cloud_tpu_vm():
        _export_tpu_coordinator_port()
        jax.distributed.initialize(initialization_timeout=timeout_s)
    from jax._src import distributed

    _state.client = distributed.global_state.client
    _state.index = jax.process_index() if _state.client is not None else 0
    _state.count = jax.process_count() if _state.client is not None else 1
    _state.requested = settings
    _state.settings = dataclasses.replace(
        settings, num_processes=_state.count, process_id=_state.index
    )
    if _state.client is not None:
        atexit.register(shutdown)
        _state.failure_watcher = threading.Thread(
            target=_watch_failures, args=(_state.client,), name="ppgd-failures", daemon=True)
        _state.failure_watcher.start()
    _tag_absl_logs()
    if _state.count > 1:
        logging.info("process %d of %d up, %d local devices", _state.index, _state.count,
                     jax.local_device_count())
    return _state.settings


def shutdown() -> None:
    """Leave the job (registered at exit by `initialize`). The coordinator waits for every
    process here, so one that finishes first does not pull the service from under the
    others (they would abort)."""
    if _state.client is not None:
        _state.client = None
        if _state.failure_watcher is not None:  # no RPC of its own in flight at the shutdown
            _state.failure_watcher.join()
        jax.distributed.shutdown()


_FAILURE_KEY = "ppgd/failure"
_FAILURE_POLL_MS = 500  # a notice ends a wait at once; the polls let shutdown() join it
FAILURE_GRACE_S = 2.0  # process 0 stays this long for the others to read a failure notice


_said_lock = threading.Lock()


def claim_saying_end() -> bool:
    """True for the first caller only: this process ends, and either its own message (the
    main thread) or another's notice (the failure watcher) says why, not both (a refusal
    every process sees at once was said twice)."""
    with _said_lock:
        first, _state.said_end = not _state.said_end, True
        return first


def report_failure(message: str, code: int = 1) -> None:
    """This process ends with an error (exit `code`): tells the others, whose failure watcher
    then exits them at once naming it, with the same code (they would otherwise wait in
    their next collective for a process that is gone, until a timeout and JAX's abort). The
    caller exits right after, without shutdown()'s barrier. A no-op single-process, or when
    another process failed first."""
    client = _state.client
    if client is None:
        return
    notice = {"process": _state.index, "message": message, "code": code}
    try:
        client.key_value_set(_FAILURE_KEY, json.dumps(notice))
    except jax.errors.JaxRuntimeError:
        return
    if is_main():  # it hosts the service the others read the notice from
        time.sleep(FAILURE_GRACE_S)


def _watch_failures(client) -> None:
    """Background, every process of a multi-process job: exits this process as soon as
    another reports a failure, with that process's status (2 for a refused input, so a
    refusal that one process saw ends every process as a refusal)."""
    while _state.client is client:
        try:
            notice = client.blocking_key_value_get(_FAILURE_KEY, _FAILURE_POLL_MS)
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" not in str(e):  # the service is gone: no spin
                time.sleep(_FAILURE_POLL_MS / 1000)
            continue
        failed = json.loads(notice)
        if _state.client is client and failed["process"] != _state.index \
                and claim_saying_end():
            os.write(2, f"{tag()} stopping: process {failed['process']}: "
                        f"{failed['message']}\n".encode())
            if is_main():  # the others read the notice from the service it hosts
                time.sleep(FAILURE_GRACE_S)
            os._exit(failed["code"])
        return


def _export_tpu_coordinator_port() -> None:
    """launch/tpu_pod.sh chooses the coordinator port (PPGD_COORDINATOR_PORT); JAX's TPU
    cluster detection reads it as JAX_COORDINATOR_PORT (worker 0's address stays detected)."""
    port = os.environ.get("PPGD_COORDINATOR_PORT")
    if port is None:
        return
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"PPGD_COORDINATOR_PORT={port!r}: expected a port number 1-65535")
    os.environ["JAX_COORDINATOR_PORT"] = port


def _on_cloud_tpu_vm() -> bool:
    from jax._src.cloud_tpu_init import running_in_cloud_tpu_vm

    return bool(running_in_cloud_tpu_vm)


def process_index() -> int:
    return _state.index


def process_count() -> int:
    return _state.count


def is_main() -> bool:
    """Process 0 writes run-level files (manifests, metrics, commit markers)."""
    return _state.index == 0


def tag() -> str:
    """`[p1/2]` in a multi-process run, '' otherwise: the prefix of this process's logs."""
    return f"[p{_state.index}/{_state.count}]" if _state.count > 1 else ""


class _TaggedFormatter(logging.PythonFormatter):
    def format(self, record: std_logging.LogRecord) -> str:
        text = super().format(record)
        return f"{tag()} {text}" if tag() else text


def _tag_absl_logs() -> None:
    logging.use_absl_handler()  # as absl.app.run does; also for scripts that skip it
    logging.get_absl_handler().setFormatter(_TaggedFormatter())


# ----------------------------------------------------------------------------- agreement


def _key(kind: str, name: str = "") -> str:
    """A fresh key per call; all processes call in the same order, so numbers line up."""
    base = f"ppgd/{kind}/{name}"
    n = _state.seq.get(base, 0)
    _state.seq[base] = n + 1
    return f"{base}#{n}"


def _ms(timeout_s: float) -> int:
    return int(timeout_s * 1000)


def _kv_get(key: str, timeout_s: float, what: str) -> str:
    try:
        return _state.client.blocking_key_value_get(key, _ms(timeout_s))
    except jax.errors.JaxRuntimeError as e:
        raise RuntimeError(f"{tag()} {what}: no value for {key!r} within {timeout_s:g} s: {e}") from e


def barrier(name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Wait until every process reaches `barrier(name)`; a no-op single-process."""
    if _state.client is None:
        return
    key = _key("barrier", name)
    try:
        _state.client.wait_at_barrier(key, _ms(timeout_s))
    except jax.errors.JaxRuntimeError as e:
        raise RuntimeError(f"{tag()} barrier {name!r} timed out after {timeout_s:g} s: {e}") from e


def broadcast_from_main(value: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Process 0's `value` (JSON-able) in every process. Single-process it still round-trips
    through JSON, so a value that cannot cross processes fails on a laptop too."""
    text = json.dumps(value)
    if _state.client is None:
        return json.loads(text)
    key = _key("broadcast")
    if is_main():
        _state.client.key_value_set(key, text)
        return json.loads(text)
    return json.loads(_kv_get(key, timeout_s, "broadcast_from_main"))


def gather_from_all(value: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Every process's `value` (JSON-able), indexed by process, in every process."""
    text = json.dumps(value)
    if _state.client is None:
        return [json.loads(text)]
    key = _key("gather")
    _state.client.key_value_set(f"{key}/{_state.index}", text)
    return [json.loads(_kv_get(f"{key}/{p}", timeout_s, "gather_from_all"))
            for p in range(_state.count)]


# ----------------------------------------------------------------------------- stop signal

_NOTICE_KEY = "ppgd/stop/notice"
_PROPOSAL_KEY = "ppgd/stop/proposal"
_POLL_MS = 200


class StopSignal:
    """[C5] SIGTERM/SIGINT on any process -> every process stops at the same call of
    `should_stop`. Install once per process, from the main thread, after `initialize()`.

    Usage (close, i.e. leaving the `with`, only after the save: until then a second
    signal is noted in `signals_received` and ignored):
        with StopSignal() as stop:
            for step in range(start, end):
                state = train_step(state)       # async dispatch, no sync added
                if stop.should_stop(step):      # True at the same call everywhere
                    save(state)                 # (skip during faithfulness warmup [C5])
                    break
    """

    _installed = False

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT),
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if StopSignal._installed:
            raise RuntimeError("StopSignal is already installed in this process")
        if _state.requested is None:
            raise RuntimeError("call dist.initialize() before StopSignal() (single-process too)")
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._decided = threading.Event()
        self._calls = 0  # completed should_stop calls
        self._proposal: int | None = None  # call at which this process may stop first
        self._decision: int | None = None  # agreed call (same everywhere)
        self._error: BaseException | None = None
        self._closed = False
        # names of every signal seen, in order; from those whose raise start-up lost too
        self.signals_received: list[str] = list(startup_signals.seen)
        self.reason: str | None = None  # e.g. "SIGTERM on p1", once known here
        self.stop_step: int | None = None  # the `step` passed when should_stop said True
        self._previous = {s: signal.signal(s, self._handle) for s in signals}
        StopSignal._installed = True
        self._watcher = None
        if _state.client is not None:
            self._watcher = threading.Thread(target=self._watch, name="ppgd-stop", daemon=True)
            self._watcher.start()
        atexit.register(self.close)

    def _handle(self, signum: int, frame: Any) -> None:
        # Runs in the main thread between bytecodes: set flags only.
        self.signals_received.append(signal.Signals(signum).name)

    def should_stop(self, step: int) -> bool:
        """Call once per step boundary with the completed step; True (in every process at
        the same call) when the run must stop after this step."""
        with self._lock:
            self._calls += 1
            n = self._calls
            if self._proposal is None:
                if not self.signals_received:
                    return False
                self._propose(n)
        if not self._decided.wait(self._timeout_s):
            raise RuntimeError(
                f"{tag()} stop consensus: no decision within {self._timeout_s:g} s "
                "(did another process die?)"
            )
        if self._error is not None:
            raise RuntimeError(f"{tag()} stop consensus failed: {self._error}") from self._error
        if n == self._decision:
            self.stop_step = step
            logging.warning("stopping %s (%s)", f"after step {step}" if step >= 0
                            else "before step 1 (during the faithfulness warmup)", self.reason)
        return n >= self._decision

    def _propose(self, call: int) -> None:
        """Under the lock: fix this process's earliest stop call, tell the others."""
        self._proposal = call
        if self.signals_received and self.reason is None:
            self.reason = f"{self.signals_received[0]} on p{_state.index}"
        logging.warning("stop requested (%s); this process can stop at its should_stop call #%d",
                        self.reason or "another process", call)
        if _state.client is None:
            self._decision = call
            self._decided.set()
            return
        client = _state.client
        if self.signals_received:
            client.key_value_set(_NOTICE_KEY, self.reason, allow_overwrite=True)
        client.key_value_set(f"{_PROPOSAL_KEY}/{_state.index}", str(call))

    def _watch(self) -> None:
        """Background: wait for any process's notice, propose, collect, decide."""
        client = _state.client
        try:
            while not self._closed:
                with self._lock:
                    if self._proposal is None and self.signals_received:
                        self._propose(self._calls + 1)  # main thread is busy or blocked
                try:
                    notice = client.blocking_key_value_get(_NOTICE_KEY, _POLL_MS)
                except jax.errors.JaxRuntimeError as e:
                    if "DEADLINE_EXCEEDED" not in str(e):  # e.g. coordinator gone: no spin
                        time.sleep(_POLL_MS / 1000)
                    continue
                break
            else:
                return
            with self._lock:
                if self.reason is None:
                    self.reason = notice
                if self._proposal is None:
                    self._propose(self._calls + 1)
            proposals = [
                int(client.blocking_key_value_get(f"{_PROPOSAL_KEY}/{p}", _ms(self._timeout_s)))
                for p in range(_state.count)
            ]
            self._decision = max(proposals)
        except BaseException as e:  # surfaced by should_stop in the main thread
            if self._closed:
                return
            self._error = e
        self._decided.set()

    def close(self) -> None:
        """Restore the previous signal handlers (call after the save)."""
        if self._closed:
            return
        self._closed = True
        for s, h in self._previous.items():
            signal.signal(s, h)
        StopSignal._installed = False
        if self._watcher is not None and not self._decided.is_set():
            self._watcher.join(timeout=2 * _POLL_MS / 1000)

    def __enter__(self) -> StopSignal:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
