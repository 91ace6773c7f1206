"""The device mesh from config, the ONE logical-axis rule table, and every leaf's placement.

SPEC section 8 asks for single-machine math on the global batch whatever the layout
[D1-D3]. The step functions are written on GLOBAL arrays with jnp; this module only says
where each array lives, so jit + NamedSharding makes XLA insert the collectives (the batch
mean of a per-shard loss, the global per-component sums of imp-min [D2], the all-reduce
that averages per-shard gradients [D1]).

Mesh. Two axes, `data` and `fsdp`. Each is the product of an ICI part (devices of one
slice; on CPU/GPU, of one process) and a DCN part (across slices; across processes on
CPU/GPU). Sizes come from `mesh.*`; -1 = the rest. With more than one granule (slice or
process) the mesh is built by the hybrid ICI/DCN constructor so the DCN axis crosses the
slow links only. Sizes that do not multiply to the device count, or a global batch that
does not divide over the batch shards, are refused naming the field before any compute.

Placement. Each leaf's LOGICAL axes (`batch`, `embed`, `channels`, ...) are declared by
the module that defines it (ppgd_tpu/axes.py: `axes.field` on the target's, the CI fn's,
the components', the adversary's and the envelope's fields); the flax rule table `RULES`
maps logical axes to mesh axes. A leaf nothing declares is an error naming it, never a
silent replication, and so is a logical name `RULES` lacks. Decisions:

| what                                   | placement                                         |
|----------------------------------------|---------------------------------------------------|
| batch, envelope, CI, masks, `bsc` src  | rows over (data, fsdp); C and positions replicated |
| `sc` sources, scalars, metrics         | replicated (identical on every replica [D1])      |
| V/U, CI fn, target, Adam moments       | the `embed` dim over fsdp (FSDP) when the leaf has |
|                                        | >= mesh.fsdp_min_elements elements, else replicated |

Moments follow their parameter: the parameters' axes are mapped over the optimizer state
(optax.tree_map_params), whatever the optimizer.
Draws are layout-independent because threefry is partitionable [R1]: a placed init, a
sharded batch draw and a single-device one give the same numbers.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np
from absl import logging
from flax import linen as nn
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from ppgd_tpu import axes
from ppgd_tpu.config import Config, ConfigError, MeshConfig
from ppgd_tpu.tracing import BATCH_AXES

AXES = ("data", "fsdp")

# The ONE rule table: logical axis -> mesh axes (flax partitioning rules).
RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", BATCH_AXES),  # batch rows: every data shard holds B / n_batch_shards rows
    ("embed", "fsdp"),      # the FSDP dim of a large weight (and of its moments)
    ("shared", None),       # the size-1 batch axis of `sc` sources: shared by every row
    ("seq", None),          # positions
    ("channels", None),     # C (or C + 1 with the delta): components, CI, masks, sources
    ("features", None),     # toy input features
    ("hidden", None),       # the other dims of weights
    ("vocab", None),
    ("heads", None),
    ("norm", None),
    ("chunks", None),       # stacked CI-transformer chunks
    ("layers", None),       # stacked blocks of a chunk
)
_NAMES = {name for name, _ in RULES}


# The way out when the batch size is fixed: a resumed run keeps it (it is the trajectory).
RESUME_COUNT = ("(resuming, where the batch size is fixed) a device or process count that "
                "divides it")


class MeshError(ConfigError):
    """A mesh or placement that cannot hold this run (names the field or the leaf)."""


# ---------------------------------------------------------------- the mesh


def _fill(sizes: dict[str, int], total: int, what: str) -> dict[str, int]:
    """Resolves at most one -1 in `sizes` so their product is `total`."""
    for k, v in sizes.items():
        if v == 0 or v < -1:
            raise MeshError(f"mesh.{k}: {v} is not a size; use a positive integer or -1")
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise MeshError(f"mesh.{', mesh.'.join(free)}: at most one of these may be -1 (the "
                        f"rest of the {total} {what})")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if total % fixed:
            raise MeshError(f"mesh.{', mesh.'.join(k for k in sizes if k not in free)}: sizes "
                            f"{fixed} do not divide the {total} {what}; give sizes whose "
                            f"product divides {total}")
        sizes = {**sizes, free[0]: total // fixed}
    elif fixed != total:
        raise MeshError(f"mesh.{', mesh.'.join(sizes)} = {tuple(sizes.values())} multiply to "
                        f"{fixed}, but there are {total} {what}; give sizes that multiply "
                        f"to {total}, or -1 for one of them (the rest)")
    return sizes


def axis_sizes(cfg: MeshConfig, n_devices: int, n_granules: int = 1
               ) -> tuple[dict[str, int], dict[str, int]]:
    """(ICI sizes, DCN sizes) per mesh axis for `n_devices` split evenly into `n_granules`
    (slices, or processes on CPU/GPU). Raises MeshError naming the fields."""
    if n_devices % n_granules:
        raise MeshError(f"{n_devices} devices do not split evenly into {n_granules} "
                        "slices/processes")
    ici = _fill({"data": cfg.data, "fsdp": cfg.fsdp}, n_devices // n_granules,
                "devices per slice/process")
    dcn = _fill({"dcn_data": cfg.dcn_data, "dcn_fsdp": cfg.dcn_fsdp}, n_granules,
                "slices/processes")
    return ici, {"data": dcn["dcn_data"], "fsdp": dcn["dcn_fsdp"]}


def mesh_shape(cfg: MeshConfig, n_devices: int, n_granules: int = 1) -> dict[str, int]:
    ici, dcn = axis_sizes(cfg, n_devices, n_granules)
    return {a: ici[a] * dcn[a] for a in AXES}


def _granules(devices) -> tuple[int, bool]:
    """(number of granules, whether a granule is a process rather than a TPU slice).
    TPU slices are joined by DCN; a multi-host TPU slice is one ICI granule. Off TPU
    (CPU over gloo, GPU hosts) every process is a granule."""
    slices = {getattr(d, "slice_index", 0) for d in devices}
    if len(slices) > 1:
        return len(slices), False
    if devices[0].platform != "tpu":
        return len({d.process_index for d in devices}), True
    return 1, False


def make_mesh(cfg: MeshConfig, devices=None) -> Mesh:
    """The run's mesh over all (global) devices; hybrid ICI x DCN across granules."""
    # [R1] counter-based draws that do not depend on the layout (JAX's default since 0.5;
    # pinned here because placed init and sharded batch draws rely on it).
    jax.config.update("jax_threefry_partitionable", True)
    devices = list(jax.devices() if devices is None else devices)
    n_gran, by_process = _granules(devices)
    ici, dcn = axis_sizes(cfg, len(devices), n_gran)
    if n_gran > 1:
        grid = mesh_utils.create_hybrid_device_mesh(
            [ici[a] for a in AXES], [dcn[a] for a in AXES], devices,
            process_is_granule=by_process)
    else:
        grid = mesh_utils.create_device_mesh([ici[a] for a in AXES], devices)
    logging.info("mesh %s over %d devices: ICI %s x DCN %s (%d granule(s))",
                 dict(zip(AXES, grid.shape)), len(devices), ici, dcn, n_gran)
    return Mesh(grid, AXES)


def abstract_mesh(cfg: MeshConfig, n_devices: int, n_granules: int = 1) -> AbstractMesh:
    """The mesh's shape without devices (for the placement table of another machine)."""
    shape = mesh_shape(cfg, n_devices, n_granules)
    return AbstractMesh(tuple(shape[a] for a in AXES), AXES)


def n_batch_shards(mesh) -> int:
    return math.prod(mesh.shape[a] for a in BATCH_AXES)


def check_batches(cfg: Config, mesh) -> None:
    """[D3] every global batch divides over the batch shards, refused before any compute."""
    n = n_batch_shards(mesh)
    for field, b in (("data.batch_size", cfg.data.batch_size),
                     ("eval.batch_size", cfg.eval.batch_size)):
        if b % n:
            raise MeshError(
                f"{field}: {b} rows do not divide over the {n} batch shards of the mesh "
                f"{dict(mesh.shape)} (data x fsdp); use a multiple of {n}, or other "
                f"mesh.data / mesh.fsdp sizes, or {RESUME_COUNT}")


# ---------------------------------------------------------------- one leaf


def partition_spec(name: str, shape: tuple[int, ...], logical: tuple[str, ...], mesh,
                   cfg: Config) -> PartitionSpec:
    """The rule table applied to one leaf: small weights stay replicated; a sharded dim
    that does not divide is refused naming the leaf."""
    unknown = [a for a in logical if a not in _NAMES]
    if unknown:
        raise MeshError(f"leaf {name!r}: logical axes {unknown} are not in mesh.RULES")
    rules = RULES
    if "embed" in logical and math.prod(shape) < cfg.mesh.fsdp_min_elements:
        rules = tuple((k, None if k == "embed" else v) for k, v in RULES)
    spec = nn.logical_to_mesh_axes(logical, rules)
    for dim, (size, on) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
        if on is None:
            continue
        n = math.prod(mesh.shape[a] for a in ((on,) if isinstance(on, str) else on))
        if size % n:
            raise MeshError(f"leaf {name!r}: dim {dim} ({logical[dim]}) of size {size} does not "
                            f"divide over mesh axes {on} ({n} shards); "
                            + _fits(logical[dim], size, math.prod(shape), mesh))
    return spec


def _fits(logical: str, size: int, elements: int, mesh) -> str:
    """What would place a dim of `size` on this mesh's devices (the way out of a refusal)."""
    total = math.prod(mesh.shape.values())
    options = [str(d) for d in range(1, total + 1) if total % d == 0 and size % d == 0]
    if logical != "embed":
        return f"use a mesh whose shards divide {size}"
    fsdp = (f"one of {', '.join(options)} (what divides both {size} and the {total} devices)"
            if len(options) > 1 else f"1 (no FSDP: no other size divides both {size} and the "
            f"{total} devices)")
    return (f"use mesh.fsdp x mesh.dcn_fsdp = {fsdp}, or keep weights of {elements} elements "
            f"replicated with mesh.fsdp_min_elements={elements + 1}")


# ---------------------------------------------------------------- placements of trees


class Leaf(NamedTuple):
    """A named leaf of a run: its shape (`struct`: an array, a ShapeDtypeStruct or a
    checkpoint manifest's leaf info) and the logical axes its module declares."""

    struct: Any
    axes: axes.Axes


def with_axes(structs: dict[str, Any], declared: dict[str, axes.Axes]) -> dict[str, Leaf]:
    """{name: Leaf} from a tree's named leaves and its logical axes' (`axes.of`), named
    alike (`resume.named_leaves`)."""
    assert list(structs) == list(declared), (list(structs), list(declared))
    return {n: Leaf(x, declared[n]) for n, x in structs.items()}


def by_name(named: dict[str, dict[str, Leaf]], infos: dict[str, Any]) -> dict[str, Leaf]:
    """`infos` ({leaf name: anything with a shape}, e.g. a checkpoint's leaves) with the
    declared axes of the leaf of that name among `named` (the groups of
    `programs.run_templates`). MeshError naming a leaf the run does not have."""
    declared = {n: leaf.axes for group in named.values() for n, leaf in group.items()}
    unknown = [n for n in infos if n not in declared]
    if unknown:
        raise MeshError(f"leaf {unknown[0]!r} is not a leaf of this run (of {len(unknown)} "
                        "such leaves)")
    return {n: Leaf(x, declared[n]) for n, x in infos.items()}


class Placement:
    """Every leaf's NamedSharding for one run on one mesh, from its logical axes (declared
    by its module, ppgd_tpu/axes.py) and the rule table: `names(leaves)` maps {leaf name:
    Leaf} (`programs.run_templates`) to {leaf name: NamedSharding}, `tree(tree, leaves)`
    gives the same as a tree shaped like `tree`. `leading_ndim`: the run's leading axes
    ([B] or [B, T]), which `axes.ROWS` stands for."""

    def __init__(self, cfg: Config, mesh, leading_ndim: int):
        self.cfg, self.mesh, self.leading_ndim = cfg, mesh, leading_ndim
        self.replicated = NamedSharding(mesh, PartitionSpec())

    def spec(self, name: str, shape, declared: axes.Axes
             ) -> tuple[tuple[str, ...], PartitionSpec]:
        """(logical axes, mesh PartitionSpec) of the leaf `name` of `shape` declared with
        `declared`; MeshError naming it when they do not fit (see `partition_spec`)."""
        logical = declared.expand(self.leading_ndim)
        if len(logical) != len(shape):
            raise MeshError(f"leaf {name!r}: its declared logical axes {logical} do not fit "
                            f"a {len(shape)}-d array of shape {tuple(shape)}")
        return logical, partition_spec(name, tuple(shape), logical, self.mesh, self.cfg)

    def sharding(self, name: str, shape, declared: axes.Axes) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(name, shape, declared)[1])

    def names(self, leaves: dict[str, Leaf]) -> dict[str, NamedSharding]:
        """{name: Leaf} -> {name: NamedSharding}."""
        return {n: self.sharding(n, x.struct.shape, x.axes) for n, x in leaves.items()}

    def tree(self, tree, leaves: dict[str, Leaf]):
        """A tree of shardings shaped like `tree`, whose leaves `leaves` names in flatten
        order."""
        shardings = self.names(leaves)
        return jax.tree.unflatten(jax.tree.structure(tree), list(shardings.values()))

    def rows(self, leaves: dict[str, Leaf]) -> list[tuple[str, tuple, tuple, PartitionSpec, tuple]]:
        """(name, shape, logical axes, spec, per-device shard shape) for the table."""
        out = []
        for n, x in leaves.items():
            shape = tuple(x.struct.shape)
            logical, spec = self.spec(n, shape, x.axes)
            out.append((n, shape, logical, spec, NamedSharding(self.mesh, spec).shard_shape(shape)))
        return out


def place(tree, shardings):
    """Host values -> global arrays on `shardings`, each process filling only its own
    devices (works with several processes; no single-device copy of the whole tree)."""
    def one(x, s):
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])
    return jax.tree.map(one, tree, shardings)


def global_batch(fetch_rows, shape: tuple[int, ...], sharding: NamedSharding):
    """A global batch of `shape` on `sharding` from `fetch_rows(start, stop) -> np.ndarray`
    of those GLOBAL rows: each process reads only the rows its own devices hold (the token
    store's path; toy batches are drawn sharded inside jit instead)."""
    cache: dict[tuple, np.ndarray] = {}

    def shard(index):
        rows = index[0].indices(shape[0])[:2]
        if rows not in cache:
            cache[rows] = np.asarray(fetch_rows(*rows))
        return cache[rows][(slice(None), *index[1:])]

    return jax.make_array_from_callback(shape, sharding, shard)


def table(rows) -> str:
    """The placement table `ppgd-tpu shardings` prints."""
    header = ("leaf", "shape", "logical axes", "spec", "per-device")
    body = [(n, str(s), ",".join(lg) or "-", str(tuple(sp)), str(sh))
            for n, s, lg, sp, sh in rows]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in [header, *body])
