"""SIGINT/SIGTERM before a run's loop: stop at once, and never lose the signal.

The CLI's handler raises (KeyboardInterrupt, or Terminated for SIGTERM) so that start-up
(target pretraining, compiles) stops at once. Two places cannot take a raise:
- an import: an extension initialising (numpy, jaxlib) turns it into an ImportError with a
  printed traceback, or aborts the process. A signal that arrives during an import is
  delivered again (`_thread.interrupt_main`) as soon as the main thread has left it.
- a gc callback (JAX registers one): Python ignores an exception raised there. So the
  handler records every signal in `seen`: `dist.StopSignal` starts with it (the run then
  stops at its first step boundary [C5]), loops without a StopSignal call `raise_if_seen`,
  and the CLI reports an error that follows a signal as the interruption it is.
Stdlib only: the handler is installed before anything heavy is imported.
"""

from __future__ import annotations

import _thread
import atexit
import os
import signal
import sys
import threading
import time

# Set by `ppgd-tpu launch-local` for its children: the launcher's pid (follow_launcher).
LAUNCHER_PID = "PPGD_LAUNCHER_PID"

seen: list[str] = []  # names of the signals the handler took, in order
_deferred: set[int] = set()  # signals waiting for the main thread to leave an import
_redelivered: set[int] = set()  # ... and now delivered again (not new signals)
_finished_at: int | None = None  # len(seen) when the command's work was done


class Terminated(BaseException):
    """SIGTERM before a run's loop (as KeyboardInterrupt is SIGINT's)."""


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _redeliver(signum: int) -> None:
    """Thread: once the main thread has left its imports, the signal again."""
    main = threading.main_thread().ident
    while _importing(sys._current_frames().get(main)):
        time.sleep(0.01)
    _deferred.discard(signum)
    _redelivered.add(signum)
    _thread.interrupt_main(signum)


def _raise(signum: int, frame) -> None:
    if signum in _redelivered:
        _redelivered.discard(signum)
    else:
        seen.append(signal.Signals(signum).name)
        if _finished_at is not None and len(seen) == _finished_at + 1:
            return  # the first signal after the work is done: the process is ending anyway
    if _importing(frame):
        if signum not in _deferred:  # one redelivery for any number of signals meanwhile
            _deferred.add(signum)
            threading.Thread(target=_redeliver, args=(signum,), daemon=True).start()
        return
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


def install() -> None:
    """From the main thread, first thing: SIGINT and SIGTERM raise (and are recorded), and
    a raise that Python ignores is not printed as a traceback (it is not lost: `seen`)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _raise)
    if sys.unraisablehook is not _quiet:
        _quiet.previous = sys.unraisablehook
        sys.unraisablehook = _quiet
        atexit.register(_ignore_from_now_on)  # first registered: runs after JAX's own


def _ignore_from_now_on() -> None:
    """The exit status is decided and every wait (JAX's shutdown) is over: what is left is
    teardown. A signal there used to end a process that had saved and said so with 143,
    for CPython puts back the default action midway, or raise in half-cleared modules."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, signal.SIG_IGN)


def follow_launcher() -> None:
    """In a child of `ppgd-tpu launch-local`: SIGTERM when the launcher dies (SIGKILLed, or
    its terminal closed), so the child saves and stops [C5] instead of running on, orphaned,
    until a collective times out. Linux (prctl PR_SET_PDEATHSIG); elsewhere nothing. The
    variable is taken out of the environment: this process's own children have another
    parent."""
    pid = os.environ.pop(LAUNCHER_PID, None)
    if pid is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != int(pid):  # it died before the request was made
        os.kill(os.getpid(), signal.SIGTERM)


def _quiet(unraisable) -> None:
    if not isinstance(unraisable.exc_value, (KeyboardInterrupt, Terminated)):
        _quiet.previous(unraisable)


def finished() -> None:
    """The command's work is done (a run complete, or stopped and saved): the next signal
    is only noted. Raised, it would end a process that only waits for the others to finish
    (process 0 writing the summary) as failed, and the failure report would take them down
    mid-write. A second signal still raises."""
    global _finished_at
    _finished_at = len(seen)


def raise_if_seen() -> None:
    """At a safe point of a loop that has no StopSignal: raise a signal whose raise was lost."""
    if seen:
        raise Terminated if seen[0] == "SIGTERM" else KeyboardInterrupt
