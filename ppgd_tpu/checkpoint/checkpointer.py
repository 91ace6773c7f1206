"""Save (async, multi-process) and restore of flat `{leaf path: array}` checkpoints.

The caller flattens its train state to leaf paths starting with a part name [C2]
("decomposition/components/V/linear1", "training/opt_components/0/mu/V/linear1", ...); this
module knows nothing else about the state.

Save protocol for one step, run by every process in the background thread:
  1. process 0 clears any leftover of a dead attempt at this step, writes the manifest and
     creates every leaf array (metadata only);             barrier "<step>/prepared"
  2. every process writes the shards it owns (replica 0);  barrier "<step>/written"
  3. process 0 writes the commit marker LAST [C4], then applies retention;
                                                           barrier "<step>/committed"
so a save that has returned on ANY process is committed and visible to every process.
`barrier(name)` must block until every process has called it with that name (e.g. the
jax.distributed client's wait_at_barrier); it is only needed with more than one process.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from typing import Any, Callable, Mapping

import jax
from absl import logging

from ppgd_tpu.checkpoint import arrays as arrays_io
from ppgd_tpu.checkpoint import manifest as mf
from ppgd_tpu import storage

Barrier = Callable[[str], None]


def _no_barrier(name: str) -> None:
    del name


def write_step(
    run_dir: str,
    step: int,
    leaves: Mapping[str, arrays_io.HostLeaf],
    manifest: mf.Manifest,
    *,
    process_index: int,
    barrier: Barrier,
    keep_last_n: int | None,
    keep_every: int | None,
) -> bool:
    """The blocking save protocol (module docstring). Returns False if `step` was already
    committed (resume is exact [C3], so the stored state is this state) and nothing was done."""
    sdir = mf.step_dir(run_dir, step)
    if mf.is_committed(sdir):
        logging.info("checkpoint step %d already committed at %s; not rewriting it", step, sdir)
        return False
    if process_index == 0:
        storage.remove_tree(sdir)
        mf.write_manifest(sdir, manifest)
        arrays_io.create_leaves(sdir, manifest.leaves)
    barrier(f"ppgd_ckpt/{step}/prepared")
    arrays_io.write_leaves(sdir, leaves)
    barrier(f"ppgd_ckpt/{step}/written")
    if process_index == 0:
        mf.commit(sdir)
        if keep_last_n is not None:
            deleted = mf.retain(run_dir, keep_last_n, keep_every)
            if deleted:
                logging.info("retention deleted checkpoint step(s) %s", deleted)
    barrier(f"ppgd_ckpt/{step}/committed")
    return True


# How long a command that is failing anyway waits for its save in flight before leaving it
# uncommitted (a resume then uses the checkpoint before it [C4]): long enough for a save
# that works, short of Cloud Storage's retries when the failure is that it is unreachable.
ABANDON_AFTER_S = 30.0


def _in_background(fn, *args, **kwargs) -> concurrent.futures.Future:
    """fn(*args, **kwargs) in a daemon thread: a save left behind by a failing command does
    not hold its exit (an executor's thread is joined at interpreter exit)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run():
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=run, name="ppgd-ckpt-save", daemon=True).start()
    return future


class Checkpointer:
    """Async saver: `save` blocks only for the device-to-host copy; writing and commit run in
    a background thread, at most one save in flight (a second save first waits for the
    previous one). A background failure is raised by the next `save`/`wait`/`close`. Left
    by an exception, it waits ABANDON_AFTER_S at most for the save in flight, and that
    save's own failure does not replace the exception."""

    def __init__(
        self,
        run_dir: str,
        *,
        keep_last_n: int | None = 3,
        keep_every: int | None = None,
        config_hash: str | None = None,
        barrier: Barrier | None = None,
    ):
        self.run_dir = storage.normalize(run_dir)
        if jax.process_count() > 1 and barrier is None:
            raise ValueError(
                f"Checkpointer with {jax.process_count()} processes needs a barrier(name) "
                "callable so the commit marker is written after every process finished [C4]"
            )
        if keep_last_n is not None and keep_last_n < 1:
            raise ValueError(f"keep_last_n must be >= 1 or None, got {keep_last_n}")
        self.keep_last_n, self.keep_every = keep_last_n, keep_every
        self.config_hash = config_hash
        self.barrier = barrier or _no_barrier
        self._pending: tuple[int, concurrent.futures.Future] | None = None

    def save(self, step: int, arrays: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> None:
        self.wait()
        mf.check_leaf_paths(arrays)
        leaves = arrays_io.snapshot(arrays)
        manifest = mf.Manifest(
            step=int(step),
            leaves={n: leaf.info for n, leaf in leaves.items()},
            config_hash=self.config_hash,
            mesh=mf.mesh_description(arrays),
            process_count=jax.process_count(),
            meta=dict(meta or {}),
        )
        future = _in_background(
            write_step, self.run_dir, int(step), leaves, manifest,
            process_index=jax.process_index(), barrier=self.barrier,
            keep_last_n=self.keep_last_n, keep_every=self.keep_every,
        )
        self._pending = (int(step), future)

    def wait(self) -> None:
        """Block until the save in flight (if any) is committed; raise its error if it failed."""
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        try:
            future.result()
        except Exception as e:
            raise RuntimeError(f"background save of checkpoint step {step} to {self.run_dir} failed") from e

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self.close()
            return
        if self._pending is None:
            return
        step, future = self._pending
        self._pending = None
        try:
            future.result(timeout=ABANDON_AFTER_S)
        except concurrent.futures.TimeoutError:
            logging.warning("left the checkpoint of step %d uncommitted (still writing after "
                            "%.0f s); a resume uses the one before it", step, ABANDON_AFTER_S)
        except Exception as e:  # the command's own error says what went wrong
            logging.warning("the checkpoint of step %d failed too: %s", step,
                            storage.short_error(e))


def save(run_dir: str, step: int, arrays: Mapping[str, Any], meta=None, **kwargs) -> None:
    """Synchronous save (single call, no retention unless keep_last_n is given): for tools
    and tests; the loop saves through a Checkpointer, in the background."""
    kwargs.setdefault("keep_last_n", None)
    with Checkpointer(run_dir, **kwargs) as ckpt:
        ckpt.save(step, arrays, meta)


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    arrays: dict[str, Any]
    manifest: mf.Manifest


def restore(
    run_dir: str,
    step: int | None = None,
    *,
    shardings: Mapping[str, jax.sharding.Sharding] | None = None,
    parts: tuple[str, ...] = mf.PARTS,
) -> Restored:
    """Read a committed checkpoint (the latest if `step` is None) [C4].

    With `shardings` (one per leaf of the chosen parts) each leaf lands on that sharding --
    any mesh, whatever mesh wrote it. Without, leaves come back as host numpy, e.g.
    `restore(run, parts=("decomposition",))` for consumers with no mesh [C2]."""
    run_dir = storage.normalize(run_dir)
    if step is None:
        step = mf.latest_step(run_dir)
        if step is None:
            raise FileNotFoundError(f"no committed checkpoint under {mf.ckpts_dir(run_dir)}")
    sdir = mf.step_dir(run_dir, step)
    manifest = committed_manifest(run_dir, step)
    infos = manifest.part(parts)
    if shardings is not None:
        missing, extra = sorted(set(infos) - set(shardings)), sorted(set(shardings) - set(infos))
        if missing or extra:
            raise ValueError(
                f"shardings do not match checkpoint step {step} leaves of parts {parts}: "
                f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"not in checkpoint {extra[:5]}{'...' if len(extra) > 5 else ''}"
            )
    try:
        arrays = arrays_io.read_leaves(sdir, infos, shardings)
    except (ValueError, OSError) as e:  # tensorstore: a missing, truncated or corrupt chunk
        raise damaged(run_dir, step, e) from e
    return Restored(int(step), arrays, manifest)


def committed_manifest(run_dir: str, step: int) -> mf.Manifest:
    """The manifest of committed `step`: FileNotFoundError if the step is not committed,
    DamagedCheckpoint if its manifest cannot be read or is another step's, NewerCheckpoint
    if a newer format wrote it."""
    sdir = mf.step_dir(run_dir, step)
    if not mf.is_committed(sdir):
        raise FileNotFoundError(f"checkpoint step {step} at {sdir} is missing or incomplete (no commit marker)")
    try:
        manifest = mf.read_manifest(sdir)  # (its content's damage: DamagedCheckpoint)
    except OSError as e:  # missing, a directory, unreadable
        raise damaged(run_dir, step, e) from e
    if manifest.step != step:  # a step directory copied or renamed by hand
        raise damaged(run_dir, step, ValueError(f"its manifest is of step {manifest.step}"))
    return manifest


def damaged(run_dir: str, step: int, e: Exception) -> mf.DamagedCheckpoint:
    """The refusal of committed `step` of `run_dir` for `e`, with the way out."""
    return mf.DamagedCheckpoint(
        f"committed checkpoint {mf.step_dir(run_dir, step)} is damaged ({type(e).__name__}: "
        f"{storage.short_error(e, 300)}); `ppgd-tpu ckpt verify {run_dir}` lists what is "
        "damaged; delete that step's directory to resume from the checkpoint before it")
