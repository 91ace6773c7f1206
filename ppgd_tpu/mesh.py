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

Placement. A leaf's path (`resume.named_leaves` names, e.g. `decomposition/components/V/
linear1`) maps to LOGICAL axes (`batch`, `embed`, `channels`, ...) through `LOGICAL`;
the flax rule table `RULES` maps logical axes to mesh axes. A path no pattern matches is an
error naming it, never a silent replication. Decisions:

| what                                   | placement                                         |
|----------------------------------------|---------------------------------------------------|
| batch, envelope, CI, masks, `bsc` src  | rows over (data, fsdp); C and positions replicated |
| `sc` sources, scalars, metrics         | replicated (identical on every replica [D1])      |
| V/U, CI fn, target, Adam moments       | the `embed` dim over fsdp (FSDP) when the leaf has |
|                                        | >= mesh.fsdp_min_elements elements, else replicated |

Moments follow their parameter (the optimizer path is mapped onto the parameter path).
Draws are layout-independent because threefry is partitionable [R1]: a placed init, a
sharded batch draw and a single-device one give the same numbers.
"""

from __future__ import annotations

import math
import re

import jax
import numpy as np
from absl import logging
from flax import linen as nn
from jax.experimental import mesh_utils
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

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


# ---------------------------------------------------------------- logical axes of a leaf


def _lead(leading_ndim: int) -> tuple[str, ...]:
    """Logical names of the leading axes: [B] for toys, [B, T] for sequence targets."""
    return ("batch", *("seq",) * (leading_ndim - 1))


def logical_axes(name: str, ndim: int, cfg: Config, leading_ndim: int) -> tuple[str, ...]:
    """Logical axes of the leaf called `name` (with `ndim` dims). Raises MeshError when no
    rule covers it: a new leaf must be placed deliberately."""
    lead = _lead(leading_ndim)
    path = re.sub(r"^(decomposition|training)/", "", name)
    # Adam moments live where their parameter lives.
    path = re.sub(r"^opt_(components|ci_fn)/\d+/(mu|nu)/", r"\1/", path)
    m = re.match(r"^adversaries/([^/]+)/(.*)$", path)
    if m and m.group(1) in cfg.loss.persistent_pgd:
        path = f"adversaries.{cfg.loss.persistent_pgd[m.group(1)].scope}/{m.group(2)}"
    path = re.sub(r"^ci_fn/", f"ci_fn.{cfg.decomp.ci_fn.kind}/", path)
    path = re.sub(r"^target/", f"target.{cfg.target.kind}/", path)
    for pattern, axes in _patterns(lead):
        if re.search(pattern, path):
            if len(axes) != ndim:
                raise MeshError(f"leaf {name!r}: rule {pattern!r} gives {len(axes)} axes "
                                f"{axes} for a {ndim}-d array")
            return axes
    raise MeshError(f"leaf {name!r} has no placement rule in ppgd_tpu/mesh.py (_patterns); "
                    "add one deliberately rather than letting it replicate silently")


def _patterns(lead: tuple[str, ...]):
    """(regex on the canonical path, logical axes); first match wins."""
    per_site = ("channels",)
    batch = lead if len(lead) > 1 else (*lead, "features")  # tokens [B, T]; toys [B, n]
    return (
        (r"(^|/)(step|count|step_count)$", ()),
        (r"^metrics(/|$)", ()),
        (r"^batch$", batch),
        (r"^replay/(envelope|accumulator)/(lower|upper)/", (*lead, *per_site)),
        (r"^adversaries\.bsc/(sources|m|v)/", (*lead, *per_site)),
        (r"^adversaries\.sc/(sources|m|v)/", ("shared", *lead[1:], *per_site)),
        (r"^(components/V|replay/envelope_V)/", ("embed", "channels")),
        (r"^components/U/", ("channels", "embed")),
        # CI fns (SPEC 3)
        (r"^ci_fn\.per_component_mlp/(w1|b1|w2)/", ("channels", "hidden")),
        (r"^ci_fn\.per_component_mlp/b2/", ("channels",)),
        (r"^ci_fn\.(per_site_mlp|global_mlp)/w1(/|$)", ("embed", "hidden")),
        (r"^ci_fn\.(per_site_mlp|global_mlp)/b1(/|$)", ("hidden",)),
        (r"^ci_fn\.(per_site_mlp|global_mlp)/w2(/|$)", ("hidden", "channels")),
        (r"^ci_fn\.(per_site_mlp|global_mlp)/b2(/|$)", ("channels",)),
        (r"^ci_fn\.chunkwise_transformer/params/w_in$", ("chunks", "embed", "hidden")),
        (r"^ci_fn\.chunkwise_transformer/params/blocks/ln_[12]$", ("chunks", "layers", "norm")),
        (r"^ci_fn\.chunkwise_transformer/params/blocks/(wq|wk|wv|w1)$",
         ("chunks", "layers", "embed", "hidden")),
        (r"^ci_fn\.chunkwise_transformer/params/blocks/(wo|w2)$",
         ("chunks", "layers", "hidden", "embed")),
        (r"^ci_fn\.chunkwise_transformer/params/ln_f$", ("chunks", "norm")),
        (r"^ci_fn\.chunkwise_transformer/params/head_w/", ("chunks", "embed", "channels")),
        (r"^ci_fn\.chunkwise_transformer/params/head_b/", ("chunks", "channels")),
        # frozen targets
        (r"^target\.tms/W$", ("features", "hidden")),
        (r"^target\.tms/b$", ("features",)),
        (r"^target\.resid_mlp/W_E$", ("features", "embed")),
        (r"^target\.resid_mlp/W_in/", ("embed", "hidden")),
        (r"^target\.resid_mlp/W_out/", ("hidden", "embed")),
        (r"^target\.llama_simple_mlp/wte$", ("vocab", "embed")),
        (r"^target\.llama_simple_mlp/(blocks/\d+/ln_[12]|ln_f)$", ("norm",)),
        (r"^target\.llama_simple_mlp/blocks/\d+/(q_proj|k_proj|v_proj)$", ("embed", "heads")),
        (r"^target\.llama_simple_mlp/blocks/\d+/o_proj$", ("heads", "embed")),
        (r"^target\.llama_simple_mlp/blocks/\d+/c_fc$", ("embed", "hidden")),
        (r"^target\.llama_simple_mlp/blocks/\d+/down_proj$", ("hidden", "embed")),
    )


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
    for dim, (size, axes) in enumerate(zip(shape, tuple(spec) + (None,) * len(shape))):
        if axes is None:
            continue
        n = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
        if size % n:
            raise MeshError(f"leaf {name!r}: dim {dim} ({logical[dim]}) of size {size} does not "
                            f"divide over mesh axes {axes} ({n} shards); "
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


class Placement:
    """Every leaf's NamedSharding for one run on one mesh: `names(named)` maps {leaf name:
    array or shape} (`resume.named_leaves`) to {leaf name: NamedSharding}, `tree(tree,
    named)` gives the same as a tree shaped like `tree`."""

    def __init__(self, cfg: Config, mesh, leading_ndim: int):
        self.cfg, self.mesh, self.leading_ndim = cfg, mesh, leading_ndim
        self.replicated = NamedSharding(mesh, PartitionSpec())

    def spec(self, name: str, shape) -> tuple[tuple[str, ...], PartitionSpec]:
        logical = logical_axes(name, len(shape), self.cfg, self.leading_ndim)
        return logical, partition_spec(name, tuple(shape), logical, self.mesh, self.cfg)

    def sharding(self, name: str, shape) -> NamedSharding:
        return NamedSharding(self.mesh, self.spec(name, shape)[1])

    def names(self, named: dict) -> dict[str, NamedSharding]:
        """{name: leaf or ShapeDtypeStruct} -> {name: NamedSharding}."""
        return {n: self.sharding(n, x.shape) for n, x in named.items()}

    def tree(self, tree, named: dict):
        """A tree of shardings shaped like `tree`, whose leaves `named` names in flatten order."""
        shardings = self.names(named)
        return jax.tree.unflatten(jax.tree.structure(tree), list(shardings.values()))

    def rows(self, named: dict) -> list[tuple[str, tuple, tuple, PartitionSpec, tuple]]:
        """(name, shape, logical axes, spec, per-device shard shape) for the table."""
        out = []
        for n, x in named.items():
            logical, spec = self.spec(n, x.shape)
            shard = NamedSharding(self.mesh, spec).shard_shape(tuple(x.shape))
            out.append((n, tuple(x.shape), logical, spec, shard))
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


# ---------------------------------------------------------------- one run's placements


def run_templates(dec, target, batch: jax.ShapeDtypeStruct, window,
                  metrics: bool = True) -> tuple[dict, dict]:
    """Shapes of every step input/output: ({group: {leaf name: struct}}, {"state": the
    abstract train state}). Groups: the train state (checkpoint names), the frozen target,
    the batch, each field of the replay window `window` (replay.Window, abstract; its None
    fields absent) and (`metrics`) the step metrics, which take a trace of the whole step to
    name (~1.5 s): the steps need none, their metrics are replicated scalars."""
    from ppgd_tpu import resume  # resume -> replay -> step; mesh stays importable alone

    state = jax.eval_shape(dec.init, target)
    named = {
        "state": resume.state_leaves(state),
        "target": resume.named_leaves(target, "target"),
        "batch": {"batch": batch},
    }
    for field, tree in window._asdict().items():
        if tree is not None:
            named[field] = resume.named_leaves(tree, f"{resume.WINDOW}/{field}")
    if metrics:
        named["metrics"] = {f"metrics/{k}": v
                            for k, v in jax.eval_shape(dec.full, state, target, batch)[1].items()}
    return named, {"state": state}


def step_shardings(placement: Placement, dec, target, batch: jax.ShapeDtypeStruct, window):
    """replay.Shardings of a run: what every step variant is jitted with; `window` the
    abstract replay window with every field (replay.window_template)."""
    from ppgd_tpu.replay import Shardings

    named, trees = run_templates(dec, target, batch, window, metrics=False)
    for group in ("accumulator", "envelope_V"):  # every leaf placed, even the ones sharing
        placement.names(named.get(group, {}))  # a sharding
    return Shardings(state=placement.tree(trees["state"], named["state"]),
                     target=placement.tree(target, named["target"]),
                     batch=placement.sharding("batch", batch.shape),
                     env=placement.tree(window.envelope, named["envelope"]),
                     scalar=placement.replicated)
