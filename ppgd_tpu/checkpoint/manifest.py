"""The on-storage index of checkpoints: layout, manifest, commit marker, listing, retention.

    RUN_DIR/ckpts/<step>/manifest.json
    RUN_DIR/ckpts/<step>/decomposition/<leaf path...>   one zarr3 array per leaf   [C2]
    RUN_DIR/ckpts/<step>/training/<leaf path...>
    RUN_DIR/ckpts/<step>/COMMITTED                      written last                [C4]

A step directory without COMMITTED is incomplete: listed and warned about, never read as a
checkpoint, and deleted only once a newer step has committed.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping

from absl import logging

from ppgd_tpu import storage
from ppgd_tpu.checkpoint.arrays import LeafInfo

FORMAT_VERSION = 1
PARTS = ("decomposition", "training")
MANIFEST = "manifest.json"
COMMITTED = "COMMITTED"
_SEGMENT = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


class DamagedCheckpoint(ValueError):
    """A committed step whose manifest or arrays cannot be read back as written."""


class NewerCheckpoint(ValueError):
    """A checkpoint in a format this code predates: not damage, nothing to delete."""


CKPTS = "ckpts"  # RUN_DIR/ckpts/<step>/


def ckpts_dir(run_dir: str) -> str:
    return storage.join(storage.normalize(run_dir), CKPTS)


def step_dir(run_dir: str, step: int) -> str:
    return storage.join(ckpts_dir(run_dir), str(int(step)))


def part_of(leaf_path: str) -> str:
    return leaf_path.split("/", 1)[0]


def check_leaf_paths(paths) -> None:
    """[C2] Every leaf path is `<part>/<name>/...` with a known part and safe segments, and no
    leaf path is a prefix of another (an array directory cannot hold another array)."""
    paths = sorted(paths)
    for p in paths:
        segs = p.split("/")
        if segs[0] not in PARTS or len(segs) < 2:
            raise ValueError(
                f"leaf path {p!r} must start with one of {PARTS} followed by '/<name>'"
            )
        bad = [s for s in segs if not _SEGMENT.fullmatch(s)]
        if bad:
            raise ValueError(
                f"leaf path {p!r}: segment(s) {bad} are not [A-Za-z0-9_][A-Za-z0-9_.-]*"
            )
    for a, b in zip(paths, paths[1:]):
        if b.startswith(a + "/"):
            raise ValueError(f"leaf path {a!r} is a prefix of leaf path {b!r}")


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What a checkpoint holds; written by process 0 before any array data."""

    step: int
    leaves: dict[str, LeafInfo]
    config_hash: str | None = None
    mesh: dict | None = None  # {"axis_names": [...], "shape": [...]} of the writer's mesh
    process_count: int = 1
    meta: dict = dataclasses.field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> bytes:
        d = dataclasses.asdict(self)
        d["leaves"] = {n: i.to_json() for n, i in sorted(self.leaves.items())}
        return json.dumps(d, indent=1, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "Manifest":
        """Raises DamagedCheckpoint naming `where` unless `data` is a manifest as written."""
        fix = f"; delete {where.rsplit('/', 1)[0]} to resume from the checkpoint before it"
        try:
            d = json.loads(data)
            version = d.get("format_version")
        except (ValueError, AttributeError) as e:  # not JSON, or JSON but not an object
            raise DamagedCheckpoint(f"{where} is damaged: not a JSON object ({e}){fix}") from None
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise NewerCheckpoint(f"{where}: written by a newer ppgd-tpu (checkpoint format "
                                  f"{version}; this one reads {FORMAT_VERSION}): upgrade "
                                  "ppgd-tpu to read it")
        if version != FORMAT_VERSION:
            raise DamagedCheckpoint(f"{where} is damaged: format_version {version!r}, not "
                                    f"{FORMAT_VERSION}{fix}")
        try:
            d["leaves"] = {n: LeafInfo.from_json(i) for n, i in d["leaves"].items()}
            return cls(**d)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DamagedCheckpoint(f"{where} is damaged: {type(e).__name__}: {e}{fix}") from None

    def part(self, parts) -> dict[str, LeafInfo]:
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown checkpoint part(s) {sorted(unknown)}; valid: {PARTS}")
        return {n: i for n, i in self.leaves.items() if part_of(n) in parts}


def write_manifest(sdir: str, manifest: Manifest) -> None:
    storage.write_bytes(storage.join(sdir, MANIFEST), manifest.to_json())


def read_manifest(sdir: str) -> Manifest:
    path = storage.join(sdir, MANIFEST)
    return Manifest.from_json(storage.read_bytes(path), path)


def commit(sdir: str) -> None:
    """[C4] Mark a step complete. The caller guarantees every process finished writing."""
    storage.write_bytes(storage.join(sdir, COMMITTED), b"")


def is_committed(sdir: str) -> bool:
    return storage.exists(storage.join(sdir, COMMITTED))


@dataclasses.dataclass(frozen=True)
class StepEntry:
    step: int
    committed: bool
    path: str


def list_steps(run_dir: str) -> list[StepEntry]:
    """Every step directory under RUN_DIR/ckpts, oldest first, committed or not."""
    root = ckpts_dir(run_dir)
    steps = sorted(int(n) for n in storage.list_dirs(root) if n.isdigit())
    return [StepEntry(s, is_committed(step_dir(run_dir, s)), step_dir(run_dir, s)) for s in steps]


def committed_steps(run_dir: str) -> list[int]:
    """The steps with a committed checkpoint, oldest first."""
    return [e.step for e in list_steps(run_dir) if e.committed]


def latest_step(run_dir: str) -> int | None:
    """[C4] The newest committed step; newer incomplete ones are skipped with a warning."""
    entries = list_steps(run_dir)
    committed = [e.step for e in entries if e.committed]
    latest = max(committed, default=None)
    skipped = [e.step for e in entries if not e.committed and (latest is None or e.step > latest)]
    if skipped:
        logging.warning(
            "ignoring incomplete checkpoint step(s) %s under %s (no %s marker)",
            skipped, ckpts_dir(run_dir), COMMITTED,
        )
    return latest


def delete_step(sdir: str) -> None:
    """Un-commit first, so a half-deleted checkpoint is never seen as complete."""
    storage.remove(storage.join(sdir, COMMITTED))
    storage.remove_tree(sdir)


def retain(run_dir: str, keep_last_n: int, keep_every: int | None = None) -> list[int]:
    """Delete checkpoints older than the newest committed one, except the last `keep_last_n`
    committed ones and those whose step is a multiple of `keep_every`. Incomplete steps go
    only once a newer step has committed [C4]. Returns the deleted steps."""
    if keep_last_n < 1:
        raise ValueError(f"keep_last_n must be >= 1, got {keep_last_n}")
    if keep_every is not None and keep_every < 1:
        raise ValueError(f"keep_every must be >= 1 or None, got {keep_every}")
    entries = list_steps(run_dir)
    committed = [e.step for e in entries if e.committed]
    if not committed:
        return []
    keep = set(committed[-keep_last_n:])
    if keep_every:
        keep |= {s for s in committed if s % keep_every == 0}
    doomed = [e for e in entries if e.step < committed[-1] and e.step not in keep]
    for e in doomed:
        delete_step(e.path)
    return [e.step for e in doomed]


def mesh_description(arrays: Mapping[str, Any]) -> dict | None:
    """The mesh of the first NamedSharding-placed leaf, for the manifest (informational)."""
    import jax

    for x in arrays.values():
        sharding = getattr(x, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            m = sharding.mesh
            return {"axis_names": list(m.axis_names), "shape": [int(m.shape[a]) for a in m.axis_names]}
    return None
