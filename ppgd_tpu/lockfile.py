"""One writing command per local path: an flock'ed lock file that names its holder.

The kernel drops an flock when its process dies, even by SIGKILL, so a lock is never
stale and never needs deleting (the file stays). gs:// paths are not locked: GCS has no
flock. Used for run dirs (workspace), `pretrain --output` and `tokenize --output`."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
from collections.abc import Callable

from absl import logging

from ppgd_tpu import storage


class Held(Exception):
    """Another live process holds the lock: `holder` says which (pid and host)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


def _holder(fd: int) -> str:
    try:
        text = os.pread(fd, 200, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text or "its pid not yet recorded"


def acquire(lock_file: str) -> int | None:
    """Takes `lock_file` (exclusive, non-blocking; its dir must exist) -> its open fd
    (closing it releases the lock); None on a filesystem without locks. Raises Held while
    another process holds it, OSError when the file cannot be opened."""
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = _holder(fd)
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise Held(holder) from None
        logging.warning("%s: cannot lock (%s); this filesystem has no file locks, so another "
                        "command writing the same path would not be detected", lock_file,
                        os.strerror(e.errno or 0))
        return None
    me = f"pid {os.getpid()} on host {socket.gethostname()}"
    if _holder(fd) != me:  # the same process taking it again changes nothing
        os.ftruncate(fd, 0)
        os.pwrite(fd, me.encode() + b"\n", 0)
    return fd


@contextlib.contextmanager
def holding(lock_file: str, in_use: Callable[[str], Exception]):
    """Holds `lock_file` (created with its dir) for the `with` block; nothing for a gs://
    path. Raises in_use(holder) while another process holds it. Left by an exception (a
    refused input), it removes the lock file and the dir it made for it, if still empty:
    a refused command leaves nothing behind. (A process that opens the file meanwhile is
    refused by the flock, or gets a new file once this one is gone: either is right.)"""
    if storage.is_gcs(lock_file):
        yield
        return
    folder = os.path.abspath(os.path.dirname(lock_file) or ".")
    made, up = [], folder  # the dirs makedirs creates, deepest first
    while not os.path.exists(up):
        made.append(up)
        up = os.path.dirname(up)
    new_file = not os.path.exists(lock_file)
    os.makedirs(folder, exist_ok=True)
    try:
        fd = acquire(lock_file)
    except Held as e:
        raise in_use(e.holder) from None
    try:
        yield
    except BaseException:
        if new_file:
            with contextlib.suppress(OSError):
                os.remove(lock_file)
        for path in made:
            with contextlib.suppress(OSError):
                os.rmdir(path)  # only if empty
        raise
    finally:
        if fd is not None:
            os.close(fd)
