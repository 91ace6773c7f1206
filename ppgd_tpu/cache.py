"""The user's ppgd_tpu cache (`$PPGD_TPU_CACHE`, default ~/.cache/ppgd_tpu): the trained toy
targets (targets/build.py) and the persistent XLA compile cache of `ppgd-tpu` runs (JAX's
own, as MaxText and levanter enable it): a second run of a config loads its programs
instead of compiling them again.

Measured on the TMS 5-2 ref config (20 steps, its evals and figures; README, "Compiled
programs", has today's figures): 28 s cold, 15 s with the cache warm, but 21 s under JAX's
default threshold (only compiles over 1 s are cached), so every program is cached. Entries
are ~10 KiB for toys.

Where: `$PPGD_TPU_COMPILE_CACHE` if it is a path, else `<root>/xla/<machine>`, `<machine>`
hashing jaxlib's version and the host CPU's model and features: an XLA:CPU executable
compiled for one instruction set must never be loaded on a host without it (a home
directory shared over NFS). `PPGD_TPU_COMPILE_CACHE=off` turns it off; a cache the user
configured for JAX (JAX_COMPILATION_CACHE_DIR or jax.config) wins. Set by the `ppgd-tpu`
entry point only, like the allocator setting (cpu_runtime): the Python API and the tests
leave JAX's configuration alone. A cached program is the compiled program, so it changes no
result.

A root that cannot be written (read-only, or a file) costs only speed, never a run: JAX warns
and compiles, and a trained toy target is used uncached with a warning (targets/build.py).
"""

from __future__ import annotations

import hashlib
import os
import platform

import filelock

MAX_BYTES = 1 << 30  # JAX evicts least recently used entries beyond this
LOCK_FILE, LOCK_TIMEOUT_S = ".lockfile", 10.0  # JAX's, held while it writes or evicts
OFF = ("off", "0", "false", "no")


def root(env=os.environ) -> str:
    """The cache root: `$PPGD_TPU_CACHE`, default ~/.cache/ppgd_tpu."""
    return env.get("PPGD_TPU_CACHE", os.path.expanduser("~/.cache/ppgd_tpu"))


def machine_fingerprint() -> str:
    """jaxlib version, architecture, CPU model and feature flags, hashed."""
    import jaxlib.version

    cpu = ""
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = "".join(sorted({line for line in fh if line.startswith(("model name", "flags"))}))
    except OSError:
        cpu = platform.processor()
    blob = "\n".join([jaxlib.version.__version__, platform.machine(), cpu])
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def enable_compile_cache(env=os.environ) -> str | None:
    """Points JAX's persistent cache at the run cache (see the module doc); returns the
    directory in use, or None when it is off."""
    import jax

    setting = env.get("PPGD_TPU_COMPILE_CACHE", "")
    if setting.lower() in OFF:
        return None
    if env.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
        return env.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir
    path = setting or os.path.join(root(env), "xla", machine_fingerprint())
    drop_torn_entries(path)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
    return path


def drop_torn_entries(path: str) -> list[str]:
    """Removes the entries a killed writer left: JAX writes `<key>-cache`, then `<key>-atime`,
    and never rewrites an existing key, so a torn (empty, or atime-less) entry would fail to
    load, with a warning, on every later run. Returns the removed names. Under JAX's own
    lock of the cache: an entry another command is writing now is not torn."""
    if not os.path.isdir(path):  # no cache yet, or not a directory (JAX warns and compiles)
        return []
    try:
        with filelock.FileLock(os.path.join(path, LOCK_FILE), timeout=LOCK_TIMEOUT_S):
            return _drop_torn(path)
    except (OSError, filelock.Timeout):  # not writable, or busy: left to a later run
        return []


def _drop_torn(path: str) -> list[str]:
    names = set(os.listdir(path))
    torn = []
    for name in sorted(names):
        if not name.endswith("-cache"):
            continue
        full = os.path.join(path, name)
        try:
            if os.path.getsize(full) == 0 or name[:-len("cache")] + "atime" not in names:
                os.remove(full)
                torn.append(name)
        except OSError:  # another process removed or replaced it: its business
            pass
    return torn
