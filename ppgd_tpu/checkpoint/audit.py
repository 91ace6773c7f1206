"""Inspect stored checkpoints without a mesh: `ls`, `digest`, `verify`.

`digest` hashes the LOGICAL array bytes (C order, little-endian) streamed in row blocks, not
the chunk files, so identical state has an identical digest whatever mesh or process count
wrote it. `verify` reads everything back and reports damage.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math

import numpy as np

from ppgd_tpu.checkpoint import arrays as arrays_io
from ppgd_tpu.checkpoint import manifest as mf
from ppgd_tpu import storage

_BLOCK_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class StepListing:
    step: int
    committed: bool
    bytes: int
    path: str


def ls(run_dir: str) -> list[StepListing]:
    """Every step directory, committed or not, with its size in bytes."""
    return [
        StepListing(e.step, e.committed, sum(storage.list_files(e.path).values()), e.path)
        for e in mf.list_steps(run_dir)
    ]


def _row_blocks(t, info: arrays_io.LeafInfo):
    """Yield the array as consecutive C-order blocks of whole rows (bounded memory)."""
    if not info.shape or info.shape[0] == 0:
        yield np.asarray(t.read().result())
        return
    row_bytes = math.prod(info.shape[1:]) * np.dtype(t.dtype.numpy_dtype).itemsize
    rows = max(1, _BLOCK_BYTES // max(row_bytes, 1))
    for start in range(0, info.shape[0], rows):
        yield np.asarray(t[start : min(start + rows, info.shape[0])].read().result())


def _leaf_digest(t, info: arrays_io.LeafInfo) -> str:
    h = hashlib.sha256(f"{info.dtype}{list(info.shape)}".encode())
    for block in _row_blocks(t, info):
        h.update(np.ascontiguousarray(block).tobytes())  # native order: little-endian on TPU/x86/arm
    return h.hexdigest()


@dataclasses.dataclass(frozen=True)
class Digest:
    step: int
    leaves: dict[str, str]  # leaf path -> sha256 of dtype, shape and C-order bytes
    overall: str


def _committed_step(run_dir: str, step: int | None) -> int:
    if step is None:
        step = mf.latest_step(run_dir)
        if step is None:
            raise FileNotFoundError(f"no committed checkpoint under {mf.ckpts_dir(run_dir)}")
    if not mf.is_committed(mf.step_dir(run_dir, step)):
        raise FileNotFoundError(f"checkpoint step {step} under {mf.ckpts_dir(run_dir)} is missing or incomplete")
    return step


def digest(run_dir: str, step: int | None = None) -> Digest:
    step = _committed_step(run_dir, step)
    sdir = mf.step_dir(run_dir, step)
    manifest = mf.read_manifest(sdir)
    leaves = {}
    for n, i in sorted(manifest.leaves.items()):
        try:
            leaves[n] = _leaf_digest(arrays_io.open_leaf(storage.join(sdir, n), n, i), i)
        except ValueError as e:  # tensorstore: a chunk missing, cut short or corrupt
            raise mf.DamagedCheckpoint(f"{storage.join(sdir, n)} is damaged: "
                                       f"{storage.short_error(e, 300)}") from None
    overall = hashlib.sha256("".join(f"{n}\t{d}\n" for n, d in leaves.items()).encode())
    return Digest(step, leaves, overall.hexdigest())


def _expected_chunk_keys(info: arrays_io.LeafInfo) -> set[str]:
    if not info.shape:
        return {"c"}
    grid = [range(math.ceil(s / c)) for s, c in zip(info.shape, info.chunks)]
    return {"c/" + "/".join(map(str, idx)) for idx in itertools.product(*grid)}


def _leaf_problems(sdir: str, name: str, info: arrays_io.LeafInfo, files: dict[str, int]) -> list[str]:
    prefix = name + "/"
    present = {k[len(prefix):] for k in files if k.startswith(prefix)} - {"zarr.json"}
    expected = _expected_chunk_keys(info)
    problems = [f"{name}: missing chunk {k}" for k in sorted(expected - present)[:5]]
    if len(expected - present) > 5:
        problems.append(f"{name}: ... {len(expected - present)} chunks missing in all")
    problems += [f"{name}: unexpected file {k}" for k in sorted(present - expected)[:5]]
    try:
        t = arrays_io.open_leaf(storage.join(sdir, name), name, info)
        for _ in _row_blocks(t, info):
            pass
    except Exception as e:  # any failure to read back is damage; report it, keep going
        problems.append(f"{name}: unreadable: {storage.short_error(e)}")
    return problems


@dataclasses.dataclass(frozen=True)
class StepReport:
    step: int
    committed: bool
    problems: list[str]  # empty: every leaf read back whole; an incomplete step is not checked

    @property
    def damaged(self) -> bool:
        return self.committed and bool(self.problems)


def verify(run_dir: str) -> list[StepReport]:
    """Check every committed step: manifest readable, every expected chunk present and no
    stray ones, every leaf readable with the manifest's shape/dtype and intact checksums."""
    report = []
    for e in mf.list_steps(run_dir):
        if not e.committed:
            report.append(StepReport(e.step, False, [f"incomplete: no {mf.COMMITTED} marker (ignored by restore)"]))
            continue
        try:
            manifest = mf.read_manifest(e.path)
            files = storage.list_files(e.path)
            problems = [p for n, i in sorted(manifest.leaves.items())
                        for p in _leaf_problems(e.path, n, i, files)]
            if manifest.step != e.step:  # restore refuses it
                problems.append(f"manifest is of step {manifest.step} (a step directory "
                                "copied or renamed by hand)")
        except Exception as err:
            problems = [f"manifest unreadable: {err}"]
        committed = True
        if problems and not mf.is_committed(e.path):  # un-committed first (delete_step)
            committed, problems = False, ["deleted while being verified (a running job keeps "
                                          "only its last checkpoint.keep_last_n)"]
        report.append(StepReport(e.step, committed, problems))
    return report
