"""The mesh from config and the placement rule table (ppgd_tpu/mesh.py), in-process: sizes
and refusals are pure functions of (config, device count), and the placement table is
computed from shapes on an abstract mesh, so nothing here depends on this process's devices
(the granule test also looks at them, expecting one granule whatever their number).
"""

import ast
import contextlib
import functools
import io
import math
import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

from ppgd_tpu import axes, cli, resume
from ppgd_tpu import config as config_lib
from ppgd_tpu import mesh as mesh_lib
from ppgd_tpu.config import MeshConfig
from ppgd_tpu.programs import run_templates
from ppgd_tpu.replay import window_template
from ppgd_tpu.step import Decomposer
from ppgd_tpu.targets.base import Target

GOLDEN = Path(__file__).resolve().parent / "golden"


def test_granules_are_slices_on_tpu_and_processes_elsewhere():
    """What `make_mesh` counts as a DCN granule. The TPU layouts are a layout-only check on
    stand-in device objects (no TPU here): only `platform`, `process_index` and `slice_index`
    are read. The CPU multi-process case runs for real in
    tests/test_sharding.py::test_D3_same_trajectory_on_1_device_4_devices_and_2_processes,
    whose 2 processes x 2 gloo CPU devices must log "(2 granule(s))"; here the real devices of
    this one process make one granule."""
    from types import SimpleNamespace as D

    assert mesh_lib._granules(jax.devices()) == (1, jax.devices()[0].platform != "tpu")
    cpu = [D(platform="cpu", process_index=i // 2, slice_index=0) for i in range(4)]
    assert mesh_lib._granules(cpu) == (2, True)  # gloo CPU devices report slice_index 0
    one_slice = [D(platform="tpu", process_index=i // 4, slice_index=0) for i in range(8)]
    assert mesh_lib._granules(one_slice) == (1, False)  # multi-host, one ICI domain
    two = [D(platform="tpu", process_index=i // 4, slice_index=i // 4) for i in range(8)]
    assert mesh_lib._granules(two) == (2, False)


def test_mesh_sizes_infer_the_rest_and_split_ici_from_dcn():
    assert mesh_lib.mesh_shape(MeshConfig(), 4) == {"data": 4, "fsdp": 1}
    assert mesh_lib.mesh_shape(MeshConfig(data=2, fsdp=-1), 8) == {"data": 2, "fsdp": 4}
    # 2 processes x 2 devices: DCN data 2 (the rest of the granules) x ICI data 2
    assert mesh_lib.axis_sizes(MeshConfig(), 4, 2) == ({"data": 2, "fsdp": 1},
                                                       {"data": 2, "fsdp": 1})
    assert mesh_lib.mesh_shape(MeshConfig(data=1, fsdp=4, dcn_data=-1), 8, 2) == {
        "data": 2, "fsdp": 4}


@pytest.mark.parametrize("cfg, n, granules, needle", [
    (MeshConfig(data=3), 4, 1, "mesh.data, mesh.fsdp = (3, 1) multiply to 3, but there are 4 "
     "devices per slice/process; give sizes that multiply to 4, or -1 for one of them"),
    (MeshConfig(data=-1, fsdp=3), 4, 1, "mesh.fsdp: sizes 3 do not divide the 4 devices per "
     "slice/process; give sizes whose product divides 4"),
    (MeshConfig(data=-1, fsdp=-1), 4, 1, "mesh.data, mesh.fsdp: at most one of these may be -1"),
    (MeshConfig(data=0), 4, 1, "mesh.data: 0 is not a size"),
    (MeshConfig(dcn_data=3), 4, 2, "mesh.dcn_data, mesh.dcn_fsdp = (3, 1) multiply to 3"),
])
def test_mesh_sizes_that_do_not_fit_the_devices_are_refused_by_field(cfg, n, granules, needle):
    with pytest.raises(mesh_lib.MeshError) as e:
        mesh_lib.axis_sizes(cfg, n, granules)
    assert needle in str(e.value)


def test_D3_a_batch_that_does_not_divide_over_the_batch_shards_is_refused():
    cfg = config_lib.load(None, {"data.batch_size": "6", "eval.batch_size": "8"})
    with pytest.raises(mesh_lib.MeshError) as e:
        mesh_lib.check_batches(cfg, mesh_lib.abstract_mesh(cfg.mesh, 4))
    assert "data.batch_size: 6 rows do not divide over the 4 batch shards" in str(e.value)
    assert mesh_lib.RESUME_COUNT in str(e.value)  # a resume's way out: its batch is fixed
    cfg = config_lib.load(None, {"data.batch_size": "8", "eval.batch_size": "10"})
    with pytest.raises(mesh_lib.MeshError, match="eval.batch_size: 10"):
        mesh_lib.check_batches(cfg, mesh_lib.abstract_mesh(cfg.mesh, 4))
    mesh_lib.check_batches(cfg, mesh_lib.abstract_mesh(cfg.mesh, 2))  # 2 shards divide both


# ---------------------------------------------------------------- logical axes, declared


class TwoLayer(Target):
    """A toy target mesh.py has never heard of: x -> ReLU(x W_in) W_out, its two weights'
    logical axes declared here, where they are defined."""

    W_in: jax.Array = axes.field("features", "embed")  # [n, d]
    W_out: jax.Array = axes.field("embed", "features")  # [d, n]

    def site_weights(self):
        return {"w_in": self.W_in, "w_out": self.W_out}

    def forward(self, inputs, site_fn):
        return site_fn("w_out", jax.nn.relu(site_fn("w_in", inputs, self.W_in)), self.W_out)


class TwoLayerPlus(TwoLayer):
    """... with a leaf nobody declared axes for."""

    gate: dict[str, jax.Array]


def _two_layer_run(target):
    """{leaf: (logical axes, spec)} of a toy_decomp run of `target` on 2 data x 2 fsdp."""
    cfg = config_lib.load(str(GOLDEN / "toy_decomp.yaml"), {"mesh.fsdp_min_elements": "256"})
    dec = Decomposer(cfg, target, (8, 8))
    batch = jax.ShapeDtypeStruct((8, 8), jnp.float32)
    named, _ = run_templates(dec, target, batch, window_template(dec, target, batch),
                             metrics=False)
    placement = mesh_lib.Placement(cfg, mesh_lib.abstract_mesh(cfg.mesh, 4), 1)
    return {n: (logical, tuple(spec)) for group in named.values()
            for n, _, logical, spec, _ in placement.rows(group)}


def test_a_target_that_declares_its_axes_is_placed_without_a_rule_for_it_in_mesh_py():
    """TwoLayer's weights are placed by their declarations alone (mesh 2 data x 2 fsdp, FSDP
    from 256 elements): W_in [8, 64] on its embed dim, W_out [64, 2] too small to shard;
    its batch [8, 8] and every leaf of the run it decomposes are placed as well."""
    rows = _two_layer_run(TwoLayer(W_in=jnp.zeros((8, 64)), W_out=jnp.zeros((64, 2))))
    assert rows["target/W_in"] == (("features", "embed"), (None, "fsdp"))
    assert rows["target/W_out"] == (("embed", "features"), (None, None))
    assert rows["batch"] == (("batch", "features"), (("data", "fsdp"), None))
    # V of w_in [8, 16] is small; V of w_out [64, 16] is big: FSDP on its embed (d_in) dim
    assert rows["decomposition/components/V/w_out"] == (("embed", "channels"), ("fsdp", None))
    assert rows["training/opt_components/0/mu/V/w_out"] == rows["decomposition/components/V/w_out"]
    assert rows["training/adversaries/shared/sources/w_in"] == (("shared", "channels"),
                                                                 (None, None))
    assert rows["training/adversaries/rows/sources/w_in"] == (("batch", "channels"),
                                                               (("data", "fsdp"), None))


def test_a_leaf_without_declared_axes_is_an_error_naming_it_not_a_silent_replication():
    """A leaf no module declares axes for stops the placement, naming its path; so do
    declared axes that do not fit the leaf's rank, and a logical name the rule table lacks."""
    plus = TwoLayerPlus(W_in=jnp.zeros((8, 64)), W_out=jnp.zeros((64, 2)),
                        gate={"w_in": jnp.zeros((3,))})
    with pytest.raises(axes.AxesError, match=re.escape(
            "leaf .gate['w_in'] (shape (3,)): no logical axes declared")):
        _two_layer_run(plus)
    cfg = config_lib.load(None)
    p = mesh_lib.Placement(cfg, mesh_lib.abstract_mesh(cfg.mesh, 1), 1)
    with pytest.raises(mesh_lib.MeshError, match=re.escape(
            "leaf 'decomposition/components/V/linear1': its declared logical axes ('embed', "
            "'channels') do not fit a 3-d array")):
        p.spec("decomposition/components/V/linear1", (8, 20, 1), V_AXES)
    with pytest.raises(mesh_lib.MeshError, match=re.escape(
            "leaf 'x': logical axes ['embedding'] are not in mesh.RULES")):
        p.spec("x", (8, 20), axes.Axes(("embedding", "channels")))


V_AXES = axes.Axes(("embed", "channels"))


def test_a_sharded_dim_that_does_not_divide_is_refused_naming_the_leaf():
    cfg = config_lib.load(None, {"mesh.fsdp_min_elements": "0", "mesh.data": "1",
                                 "mesh.fsdp": "4"})
    p = mesh_lib.Placement(cfg, mesh_lib.abstract_mesh(cfg.mesh, 4), 1)
    assert tuple(p.spec("decomposition/components/V/linear1", (8, 20), V_AXES)[1]) == (
        "fsdp", None)
    with pytest.raises(mesh_lib.MeshError, match="components/V/linear1'.*size 6 does not divide"
                       ) as e:
        p.spec("decomposition/components/V/linear1", (6, 20), V_AXES)
    # the way out: an fsdp size dividing both 6 and the 4 devices, or replication
    assert ("mesh.fsdp x mesh.dcn_fsdp = one of 1, 2 (what divides both 6 and the 4 devices), "
            "or keep weights of 120 elements replicated with mesh.fsdp_min_elements=121"
            ) in str(e.value)
    for fix in ({"mesh.fsdp": "2", "mesh.data": "2"}, {"mesh.fsdp_min_elements": "121"}):
        ok = config_lib.load(None, {"mesh.fsdp_min_elements": "0", "mesh.data": "1",
                                    "mesh.fsdp": "4", **fix})
        mesh_lib.Placement(ok, mesh_lib.abstract_mesh(ok.mesh, 4), 1).spec(
            "decomposition/components/V/linear1", (6, 20), V_AXES)


@pytest.mark.parametrize("opt", [
    optax.sgd(0.1, momentum=0.9),
    optax.lion(1e-3),
    optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
], ids=["sgd_momentum", "lion", "clip_adamw"])
def test_any_optimizers_moments_are_placed_like_their_parameters(opt):
    """The train state with another optax optimizer's states: every moment takes its
    parameter's declared axes (so its placement), every other optimizer leaf is a scalar."""
    cfg = config_lib.load(str(GOLDEN / "toy_decomp.yaml"), {"mesh.fsdp_min_elements": "256"})
    target = TwoLayer(W_in=jnp.zeros((8, 64)), W_out=jnp.zeros((64, 2)))
    dec = Decomposer(cfg, target, (8, 8))

    def init():
        s = dec.init(target)
        return eqx.tree_at(lambda s: (s.opt_components, s.opt_ci_fn), s,
                           (opt.init(s.components), opt.init(s.ci_fn)))

    state = jax.eval_shape(init)
    declared = axes.of(state, opt)
    params = {**resume.named_leaves(declared.components, ""),
              **resume.named_leaves(declared.ci_fn, "")}
    p = mesh_lib.Placement(cfg, mesh_lib.abstract_mesh(cfg.mesh, 4), 1)
    moments = 0
    for field in ("opt_components", "opt_ci_fn"):
        structs = resume.named_leaves(getattr(state, field), field)
        for name, ax in resume.named_leaves(getattr(declared, field), field).items():
            param = next((q for q in params if name.endswith(q)), None)
            if param is None:  # not a moment: a step count
                assert ax == () and structs[name].shape == (), name
                continue
            moments += 1
            assert ax == params[param], name
            assert p.spec(name, structs[name].shape, ax) == p.spec(
                param, structs[name].shape, params[param])
    assert moments >= len(params)
    sharded = p.spec("m", state.components.V["w_out"].shape, declared.components.V["w_out"])
    assert tuple(sharded[1]) == ("fsdp", None)  # the check above compared real placements



# ---------------------------------------------------------------- the placement table, by rule
#
# `ppgd-tpu shardings` on a mesh with fsdp > 1, checked row by row against the placement rules
# of README.md ("Device mesh") and ppgd_tpu/mesh.py's docstring, written out here on their own
# (from the rules and the weights' layouts, not from the code's logical-axis column):
# - batch rows (the batch, the replay envelope and accumulator, `bsc` sources and their Adam
#   moments) are split over both mesh axes, data x fsdp; every other dim of them replicated;
# - a weight (V/U, CI fn params, frozen target params) is FSDP-sharded over `fsdp` on its
#   embed dim when it holds >= mesh.fsdp_min_elements elements, else replicated; no other
#   dim of it is ever sharded (C, hidden, heads, vocab, chunks); a big weight whose embed dim
#   does not divide over fsdp is refused naming it (test_a_sharded_dim_that_does_not_divide_
#   is_refused_naming_the_leaf), so here every split dim must divide;
# - Adam moments are placed exactly like their parameter;
# - `sc` sources (and moments), step counters and metrics are replicated;
# - per device, a dim holds its global size divided by the sizes of the mesh axes it is
#   split over.

ROWS = frozenset({"data", "fsdp"})
FSDP = frozenset({"fsdp"})
NO = frozenset()

# The embed dim of each weight: the residual-stream / input-feature side, never the component
# (C), hidden, heads or vocab side. None: no embed dim (biases, norms, CI-fn layers between
# hidden and C), so replicated whatever the size. An unlisted leaf fails the test: a new leaf
# needs a deliberate expectation here, as it needs declared logical axes.
EMBED_DIM = (
    (r"decomposition/components/V/[^/]+", 0),  # V [d_in, C]
    (r"decomposition/components/U/[^/]+", 1),  # U [C, d_out]
    # per-site MLP CI fn: w1 [d_in, hidden], b1 [hidden], w2 [hidden, C], b2 [C]
    (r"decomposition/ci_fn/w1/[^/]+", 0),
    (r"decomposition/ci_fn/(b1|w2|b2)/[^/]+", None),
    # chunkwise-transformer CI fn, stacked over chunks (and layers): w_in [ch, d_in, d];
    # q/k/v and MLP-in [ch, l, d, *]; attention-out and MLP-out [ch, l, *, d]; heads [ch, d, C]
    (r"decomposition/ci_fn/params/w_in", 1),
    (r"decomposition/ci_fn/params/blocks/(wq|wk|wv|w1)", 2),
    (r"decomposition/ci_fn/params/blocks/(wo|w2)", 3),
    (r"decomposition/ci_fn/params/head_w/\d+", 1),
    (r"decomposition/ci_fn/params/(blocks/ln_[12]|ln_f|head_b/\d+)", None),
    # frozen ResidMLP: W_E [features, d_embed], W_in [d_embed, d_mlp], W_out [d_mlp, d_embed]
    (r"target/W_E", 1), (r"target/W_in/\d+", 0), (r"target/W_out/\d+", 1),
    # frozen llama: wte [vocab, d], q/k/v [d, heads], o [heads, d], c_fc [d, d_mlp],
    # down [d_mlp, d], norms [d]
    (r"target/wte", 1),
    (r"target/blocks/\d+/(q_proj|k_proj|v_proj|c_fc)", 0),
    (r"target/blocks/\d+/(o_proj|down_proj)", 1),
    (r"target/(blocks/\d+/ln_[12]|ln_f)", None),
)
MOMENT = re.compile(r"training/opt_(components|ci_fn)/\d+/(mu|nu)/(.+)")


def _parameter_of(moment: str) -> str:
    kind, _, rest = MOMENT.fullmatch(moment).groups()
    return f"decomposition/{kind}/{rest}"


def _expected(name: str, shape: tuple, cfg) -> tuple[str, tuple] | None:
    """(what the leaf is, the mesh axes each of its dims is split over), or None if no rule
    above says where it goes."""
    rest = (NO,) * (len(shape) - 1)
    if MOMENT.fullmatch(name):
        got = _expected(_parameter_of(name), shape, cfg)
        return got and ("moment", got[1])
    if shape == () and re.fullmatch(r"(.*/)?(step|count|step_count)|metrics/.+", name):
        return "scalar", ()
    if name == "batch" or re.fullmatch(r"training/replay/(envelope|accumulator)/(lower|upper)/.+",
                                       name):
        return "rows", (ROWS, *rest)
    m = re.fullmatch(r"training/adversaries/([^/]+)/(sources|m|v)/.+", name)
    if m:
        scope = cfg.loss.persistent_pgd[m.group(1)].scope
        return scope, ((ROWS, *rest) if scope == "bsc" else (NO, *rest))
    for pattern, dim in EMBED_DIM:
        if re.fullmatch(pattern, name):
            spec = [NO] * len(shape)
            big = math.prod(shape) >= cfg.mesh.fsdp_min_elements
            if dim is not None and big:
                spec[dim] = FSDP
            what = "small weight" if dim is not None and not big else "weight"
            return what, tuple(spec)
    return None


def _axes(entry) -> frozenset:
    return frozenset(() if entry is None else (entry,) if isinstance(entry, str) else entry)


@functools.cache
def _shardings(case: str, devices: int, processes: int) -> tuple[dict, list]:
    """`ppgd-tpu shardings` parsed: ({mesh axis: size}, [(leaf, shape, spec as one frozenset
    of mesh axes per dim, per-device shape)])."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.run(["shardings", f"--config={GOLDEN / f'{case}_decomp.yaml'}",
                        f"--devices={devices}", f"--processes={processes}"]) == 0
    head, columns, *lines = out.getvalue().splitlines()
    assert columns.split() == ["leaf", "shape", "logical", "axes", "spec", "per-device"]
    mesh = ast.literal_eval(re.fullmatch(rf"mesh (\{{.*\}}) over {devices} devices, "
                                         rf"{processes} process\(es\)", head).group(1))
    rows = []
    for line in lines:
        name, shape, _logical, spec, local = re.split(r"\s{2,}", line)
        shape, spec = ast.literal_eval(shape), ast.literal_eval(spec)
        spec = tuple(_axes(e) for e in spec) + (NO,) * (len(shape) - len(spec))
        rows.append((name, shape, spec, ast.literal_eval(local)))
    return mesh, rows


def _violations(mesh: dict, rows: list, cfg) -> tuple[list[str], dict]:
    """Every row that breaks a placement rule, and {what: count} of the rows checked."""
    bad, seen = [], {}
    table = {name: (shape, spec, local) for name, shape, spec, local in rows}
    for name, shape, spec, local in rows:
        expected = _expected(name, shape, cfg)
        if expected is None:
            bad.append(f"{name}: no expected placement for this leaf")
            continue
        what, want = expected
        seen[what] = seen.get(what, 0) + 1
        if spec != want:
            bad.append(f"{name} {shape}: spec {spec}, want {want} ({what})")
        split = tuple(math.prod(mesh[a] for a in axes) for axes in want)
        if any(n % k for n, k in zip(shape, split)):
            bad.append(f"{name} {shape}: does not divide over {split}")
        elif local != tuple(n // k for n, k in zip(shape, split)):
            bad.append(f"{name} {shape}: {local} per device, want global / {split}")
        if what == "moment":
            param = table.get(_parameter_of(name))
            if param is None or param[:2] != (shape, spec):
                bad.append(f"{name} {shape} {spec}: not placed like its parameter {param}")
    for name, (shape, _, _) in table.items():  # every parameter has both moments
        m = re.fullmatch(r"decomposition/(components|ci_fn)/(.+)", name)
        if m and not all(f"training/opt_{m.group(1)}/0/{k}/{m.group(2)}" in table
                         for k in ("mu", "nu")):
            bad.append(f"{name}: no Adam moments in the table")
    return bad, seen


@pytest.mark.parametrize("case, devices, processes, mesh", [
    # both configs: ICI data 2 x fsdp 2 in each process, DCN data = the processes
    ("toy", 4, 1, {"data": 2, "fsdp": 2}),
    ("toy", 8, 2, {"data": 4, "fsdp": 2}),
    ("lm", 8, 2, {"data": 4, "fsdp": 2}),  # README's `shardings --devices 8 --processes 2`
])
def test_placement_table_follows_the_documented_rules(case, devices, processes, mesh):
    """Every row of `ppgd-tpu shardings` for the toy (ResidMLP, per-site MLP CI fn) and the
    tiny-LM (llama, chunkwise-transformer CI fn) configs, both with sc and bsc adversaries,
    obeys the rules above (tests/golden/<case>_decomp.yaml: inputs only, no expected output)."""
    cfg = config_lib.load(str(GOLDEN / f"{case}_decomp.yaml"))
    got_mesh, rows = _shardings(case, devices, processes)
    assert got_mesh == mesh
    bad, seen = _violations(got_mesh, rows, cfg)
    assert not bad, "\n".join(bad)
    # every kind of leaf is in the table, and the size threshold cuts both ways in it
    assert {"scalar", "rows", "sc", "bsc", "weight", "small weight", "moment"} <= set(seen), \
        seen
    sharded = [n for n, _, spec, _ in rows if FSDP in spec]
    assert any(n.startswith("decomposition/") for n in sharded), "no trained weight sharded"
    assert any(n.startswith("target/") for n in sharded), "no target weight sharded"


def test_the_placement_check_catches_a_wrong_placement():
    """The rule check above is not vacuous: each single wrong row of the real toy table is
    reported."""
    cfg = config_lib.load(str(GOLDEN / "toy_decomp.yaml"))
    mesh, rows = _shardings("toy", 4, 1)
    assert _violations(mesh, rows, cfg)[0] == []
    by_name = {r[0]: i for i, r in enumerate(rows)}

    def with_row(name, spec=None, local=None, drop=False):
        i = by_name[name]
        n, shape, s, lo = rows[i]
        new = [] if drop else [(n, shape, s if spec is None else spec, lo if local is None
                                else local)]
        return rows[:i] + new + rows[i + 1:]

    V, mu = "decomposition/components/V/layers.0.mlp_in", \
        "training/opt_components/0/mu/V/layers.0.mlp_in"  # (128, 16): FSDP-sharded
    wrong = {
        "a big weight replicated": with_row(V, (NO, NO), (128, 16)),
        "a big weight sharded on its C dim": with_row(V, (NO, FSDP), (128, 8)),
        "a small weight sharded": with_row("decomposition/components/V/layers.0.mlp_out",
                                           (FSDP, NO), (8, 16)),
        "a moment replicated, unlike its parameter": with_row(mu, (NO, NO), (128, 16)),
        "a parameter without its moment": with_row(mu, drop=True),
        "bsc sources replicated": with_row("training/adversaries/rows/sources/layers.0.mlp_in",
                                           (NO, NO), (8, 17)),
        "batch rows over data only": with_row("batch", (frozenset({"data"}), NO), (4, 20)),
        "sc sources split by rows": with_row("training/adversaries/shared/m/layers.0.mlp_in",
                                             (ROWS, NO), (1, 17)),
        "a per-device shape that is not global / shards": with_row(
            "training/adversaries/rows/sources/layers.0.mlp_in", local=(8, 17)),
        "a target weight replicated": with_row("target/W_E", (NO, NO), (20, 128)),
    }
    for what, table in wrong.items():
        assert _violations(mesh, table, cfg)[0], what
