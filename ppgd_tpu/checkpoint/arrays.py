"""Named arrays <-> zarr3 arrays in tensorstore, one array per state leaf.

Saving is split in two so the training loop blocks only for the device-to-host copy:
`snapshot` copies the shards this process owns (replica_id == 0, so every byte of a sharded
or replicated array is written exactly once across all processes) to host memory, and
`write_leaves` later writes those pieces, typically from a background thread. Chunks are the
shard shape (split further if large), so no two processes ever write the same chunk.

Reading goes onto any target sharding -- each process reads only the slices its devices
need -- or to host numpy when there is no mesh (consumers of `decomposition`).
Chunks carry a crc32c checksum and are stored even when equal to the fill value, so a
damaged chunk fails to read and so does a missing one ([C4], `verify`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import numpy as np
import tensorstore as ts

from ppgd_tpu import storage

TARGET_CHUNK_BYTES = 64 * 2**20
_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}]


@dataclasses.dataclass(frozen=True)
class LeafInfo:
    """What the manifest records for one leaf: logical shape, dtype name, chunk shape."""

    shape: tuple[int, ...]
    dtype: str
    chunks: tuple[int, ...]

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "dtype": self.dtype, "chunks": list(self.chunks)}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "LeafInfo":
        return cls(tuple(d["shape"]), str(d["dtype"]), tuple(d["chunks"]))


@dataclasses.dataclass
class HostLeaf:
    """The part of one leaf this process writes: (global index, host copy) pieces."""

    info: LeafInfo
    pieces: list[tuple[tuple[slice, ...], np.ndarray]]


def _chunks(shard_shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The shard shape, halved along its largest even dim until a chunk is <= the target.

    Chunks must tile each shard exactly so that a shard's bytes map to whole chunks."""
    chunks = [max(d, 1) for d in shard_shape]
    while math.prod(chunks) * itemsize > TARGET_CHUNK_BYTES:
        even = [i for i, c in enumerate(chunks) if c % 2 == 0]
        if not even:
            break
        i = max(even, key=lambda i: chunks[i])
        chunks[i] //= 2
    return tuple(chunks)


def _dtype_name(name: str, dtype) -> str:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        raise TypeError(
            f"leaf {name!r} has extended dtype {dtype} (a typed PRNG key?); "
            "store jax.random.key_data(key) and rewrap it with jax.random.wrap_key_data"
        )
    try:
        return ts.dtype(np.dtype(dtype)).name
    except Exception as e:
        raise TypeError(f"leaf {name!r}: dtype {dtype} cannot be stored in a checkpoint") from e


def _concrete(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(*s.indices(d)[:2]) for s, d in zip(index, shape))


def snapshot(arrays: Mapping[str, Any]) -> dict[str, HostLeaf]:
    """Copy this process's replica-0 shards of every leaf to host memory (the only blocking
    part of a save). Host numpy leaves count as replicated and are written by process 0."""
    out: dict[str, HostLeaf] = {}
    pending: list[tuple[str, LeafInfo, list]] = []
    for name, x in arrays.items():
        if isinstance(x, jax.Array):
            dtype = _dtype_name(name, x.dtype)
            shard_shape = x.sharding.shard_shape(x.shape)
            shards = [s for s in x.addressable_shards if s.replica_id == 0]
            for s in shards:
                s.data.copy_to_host_async()
            info = LeafInfo(tuple(x.shape), dtype, _chunks(shard_shape, x.dtype.itemsize))
            pending.append((name, info, shards))
        else:
            x = np.asarray(x)
            info = LeafInfo(x.shape, _dtype_name(name, x.dtype), _chunks(x.shape, x.dtype.itemsize))
            mine = jax.process_index() == 0
            pieces = [(_concrete((slice(None),) * x.ndim, x.shape), x.copy())] if mine else []
            out[name] = HostLeaf(info, pieces)
    for name, info, shards in pending:
        # A copy, not a view: on CPU a view would alias a buffer the caller may donate.
        pieces = [(_concrete(s.index, info.shape), np.array(s.data, copy=True)) for s in shards]
        out[name] = HostLeaf(info, pieces)
    return out


def _spec(path: str, info: LeafInfo | None = None) -> dict:
    spec: dict[str, Any] = {
        "driver": "zarr3",
        "kvstore": storage.kvstore(path),
        "store_data_equal_to_fill_value": True,  # else all-zero chunks are skipped
    }
    if info is not None:
        spec["metadata"] = {
            "shape": list(info.shape),
            "data_type": info.dtype,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(info.chunks)}},
            "codecs": _CODECS,
        }
    return spec


def create_leaves(root: str, infos: Mapping[str, LeafInfo]) -> None:
    """Write the metadata of every leaf array under `root` (process 0, before any data)."""
    futures = [ts.open(_spec(storage.join(root, n), i), create=True) for n, i in infos.items()]
    for f in futures:
        f.result()


def write_leaves(root: str, leaves: Mapping[str, HostLeaf]) -> None:
    """Write this process's pieces of every leaf (arrays already created), all concurrently."""
    opened = {n: ts.open(_spec(storage.join(root, n)), open=True, write=True) for n in leaves}
    commits = []
    for name, leaf in leaves.items():
        t = opened[name].result()
        for index, data in leaf.pieces:
            commits.append(t[index].write(data).commit)
    for c in commits:
        c.result()


def open_leaf(path: str, name: str, info: LeafInfo) -> ts.TensorStore:
    """Open one stored leaf for reading and check it is what the manifest says. A missing
    chunk fails its read (every chunk is stored), never reads as the fill value."""
    t = ts.open({**_spec(path), "fill_missing_data_reads": False}, open=True, read=True).result()
    if tuple(t.shape) != info.shape or t.dtype.name != info.dtype:
        raise ValueError(
            f"leaf {name!r} at {path}: stored shape {tuple(t.shape)} dtype {t.dtype.name}, "
            f"manifest says shape {info.shape} dtype {info.dtype}"
        )
    return t


def _key(index: tuple[slice, ...]) -> tuple:
    return tuple((s.start, s.stop, s.step) for s in index)


def read_leaves(
    root: str,
    infos: Mapping[str, LeafInfo],
    shardings: Mapping[str, jax.sharding.Sharding] | None = None,
) -> dict[str, Any]:
    """Read leaves back: onto `shardings[name]` (only the slices this process's devices need)
    or, with no shardings, whole to host numpy. All reads are issued before any is awaited."""
    stores = {n: open_leaf(storage.join(root, n), n, i) for n, i in infos.items()}
    if shardings is None:
        reads = {n: t.read() for n, t in stores.items()}
        return {n: np.asarray(r.result()) for n, r in reads.items()}
    plans = {}
    for name, t in stores.items():
        info, sharding = infos[name], shardings[name]
        futures = {}
        for index in sharding.addressable_devices_indices_map(info.shape).values():
            index = _concrete(index, info.shape)
            if _key(index) not in futures:
                futures[_key(index)] = t[index].read()
        plans[name] = futures
    out = {}
    for name, futures in plans.items():
        info = infos[name]
        out[name] = jax.make_array_from_callback(
            info.shape,
            shardings[name],
            lambda index, f=futures, shape=info.shape: f[_key(_concrete(index, shape))].result(),
        )
    return out
