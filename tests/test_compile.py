"""`ppgd-tpu compile` (ppgd_tpu/aot.py): the run's programs compiled by the real TPU compiler
(libtpu, the `tpu` extra) for TPU topologies, on this CPU machine. One module: the tests
that load libtpu's compiler run in one pytest worker.

Small shapes only (tests/golden/lm_decomp.yaml: d_model 64, T 16): a few seconds a
variant. The production shape's numbers are commands in README, not tests.
"""

import ast
import json
from pathlib import Path

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from ppgd_tpu import aot, cli, cmdline, hlo, resume
from ppgd_tpu import mesh as mesh_lib
from ppgd_tpu.data import lm as data_lib
from ppgd_tpu.programs import Batches, Programs

LM = str(Path(__file__).resolve().parent / "golden" / "lm_decomp.yaml")


def _compile(capsys, *args):
    code = cli.run(["compile", "--config", LM, *args])
    out, err = capsys.readouterr()
    return code, out, err


def _programs(cfg, topo):
    mesh = mesh_lib.make_mesh(cfg.mesh, topo.devices())
    target = aot._abstract_target(cfg)
    placement = mesh_lib.Placement(cfg, mesh, len(target.leading_shape((1, 1))))
    return Programs(cfg, placement, target, Batches(*data_lib.batch_structs(cfg, target))), \
        target


@pytest.fixture(scope="module")
def first_mode(tmp_path_factory):
    """The tiny LM in replay mode `first` (k 2), FSDP over the 4 chips of a v5e-4."""
    path = tmp_path_factory.mktemp("compile") / "report.json"
    code = cli.run(["compile", "--config", LM, "--topology", "v5e-4", "--mesh.data=1",
                    "--mesh.fsdp=-1", "--mesh.fsdp_min_elements=0",
                    "--data.train_batch_replay=2", "--data.replay_ci_update=first",
                    f"--json={path}"])
    return code, json.loads(path.read_text())


def test_every_variant_of_a_replay_mode_compiles_and_fits(first_mode):
    code, report = first_mode
    assert code == 0 and report["failed"] == ""
    assert [v["variant"] for v in report["variants"]] == ["full_keep", "repeat", "eval"]
    assert report["chips"] == 4 and report["mesh"] == {"data": 1, "fsdp": 4}
    for v in report["variants"]:
        assert "error" not in v, v
        m = v["memory"]
        assert 0 < m["peak"] < v["hbm_gib"] * 2**30 and m["argument"] > 0
        assert v["flops_per_chip"] > 0 and v["roofline_ms"] > 0


def test_donation_aliases_every_state_leaf_and_spares_model_and_envelope_W5(first_mode):
    """[W5] on TPU: full_keep and repeat alias every train-state leaf input to output; the
    repeat step's (model, envelope) argument is neither donated nor aliased."""
    _, report = first_mode
    by = {v["variant"]: v["donation"] for v in report["variants"]}
    n = len(report["state_leaves"])
    for name in ("full_keep", "repeat"):
        assert by[name]["ok"] and by[name]["state"] == {
            "leaves": n, "donated": n, "aliased": n, "unused": 0}, by[name]
    assert by["repeat"]["model_envelope"]["donated"] == 0
    assert by["repeat"]["model_envelope"]["aliased"] == 0
    assert by["eval"]["state"]["donated"] == 0


def test_activations_stay_batch_sharded_under_fsdp_D1(first_mode):
    """Each chip computes its share of the batch: the per-chip matmul FLOPs of the compiled
    program times the chips is the traced program's global count (FSDP shards the weights
    on the dim matmuls contract over; without the row pins (tracing.shard_rows) each chip
    computed the whole batch: balance ~1/chips)."""
    _, report = first_mode
    for v in report["variants"]:
        assert 0.8 < v["flops_balance"] < 1.3, (v["variant"], v["flops_balance"])
        assert v["collectives"]["all-gather"]["count"] > 0  # FSDP gathers its weights


def test_two_slices_put_the_data_axis_across_dcn(capsys, tmp_path):
    code, out, _ = _compile(capsys, "--topology", "v5e-4", "--slices", "2", "--variants=full",
                            f"--json={tmp_path / 'r.json'}")
    report = json.loads((tmp_path / "r.json").read_text())
    assert code == 0, out
    assert report["chips"] == 8 and report["mesh"] == {"data": 4, "fsdp": 2}
    assert [v["variant"] for v in report["variants"]] == ["full"]  # --variants
    assert "x 2 slices: 8 chips" in out
    for v in report["variants"]:
        assert 0.8 < v["flops_balance"] < 1.3 and v["donation"]["ok"], v


def test_state_per_chip_shrinks_by_the_fsdp_factor():
    """At data 4 every weight and moment is whole on each chip; at fsdp 4 each one FSDP
    shards holds a quarter of itself per chip (batch-row leaves, the bsc sources, are split
    4 ways in both)."""
    topo = aot.Topology.parse("v5e-4")
    per = {}
    for data, fsdp in ((4, 1), (1, 4)):
        cfg = cmdline.parse_config_args(["--config", LM, "--mesh.fsdp_min_elements=0",
                                     f"--mesh.data={data}", f"--mesh.fsdp={fsdp}"])[0]
        programs, target = _programs(cfg, topo)
        per[fsdp] = {n: (b, sh) for n, b, sh in aot.state_per_chip(programs, target)}
    assert set(per[1]) == set(per[4])
    fsdp_only = [n for n in per[4] if per[4][n][1] and not per[1][n][1]]
    assert any("ci_fn" in n for n in fsdp_only) and any("/mu/" in n for n in fsdp_only)
    assert any(n.startswith("decomposition/components/") for n in fsdp_only)
    for n, (b, _) in per[4].items():
        assert per[1][n][0] == (4 * b if n in fsdp_only else b), n


def test_a_config_that_does_not_fit_exits_1_naming_the_variant(capsys):
    """2048 rows of 512 tokens on one v5e chip: the step's temporaries (~200 GiB) overflow
    its 16 GiB; the eval (8 rows) fits."""
    code, out, _ = _compile(capsys, "--topology", "v5e-1", "--data.batch_size=2048",
                            "--eval.batch_size=8", "--target.llama_simple_mlp.max_seq_len=512",
                            "--mesh.data=1", "--mesh.fsdp=1")
    assert code == 1
    failure = out.strip().splitlines()[-1]
    assert failure.startswith("ppgd-tpu compile: error: variant full does not compile for "
                              "v5e-1: RESOURCE_EXHAUSTED"), failure
    assert "train state" in failure and "data.batch_size" in failure  # the hint


def test_a_variant_the_mode_does_not_run_exits_2(capsys):
    code, _, err = _compile(capsys, "--topology", "v5e-4", "--variants=repeat")
    assert code == 2
    assert "--variants: repeat not run by replay mode 'every'; its variants: full, eval" in err


@pytest.mark.parametrize("name", ["v4-31", "v9-8", "tpu", "v5e-3"])
def test_an_unknown_topology_exits_2_listing_the_known_ones(capsys, name):
    code, _, err = _compile(capsys, "--topology", name)
    assert code == 2
    assert f"--topology: {name!r} is not a TPU slice type" in err
    assert "v4-32" in err and "v5litepod-256" in err and "v6e-16" in err


def test_topologies_resolve_to_the_chip_grids_gcloud_names():
    grids = {"v4-8": (2, 2, 1), "v4-32": (2, 2, 4), "v5p-64": (2, 4, 4), "v5e-1": (1, 1),
             "v5e-8": (2, 4), "v5litepod-256": (16, 16), "v6e-16": (4, 4)}
    for name, grid in grids.items():
        t = aot.Topology.parse(name)
        assert aot._grid(t.chips, t.chip.grid_dims) == grid, name
    assert len(aot.Topology.parse("v4-32").devices()) == 16  # megacore: a chip a device
    assert len(aot.Topology.parse("v5e-16", slices=2).devices()) == 32


def test_the_shardings_table_is_what_the_compiled_step_takes(capsys):
    """The golden placement table of `ppgd-tpu shardings` (mesh.Placement, from shapes) and
    the input shardings of the step XLA compiled for a TPU topology agree, leaf by leaf."""
    assert cli.run(["shardings", "--config", LM, "--devices", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("leaf "))
    table = {}
    for line in lines[start + 1:]:
        name, rest = line.split(None, 1)
        spec = ast.literal_eval(rest[rest.index("  ("):].strip().split(")  ")[0] + ")")
        table[name] = PartitionSpec(*spec)
    cfg = cmdline.parse_config_args(["--config", LM])[0]
    programs, target = _programs(cfg, aot.Topology.parse("v5e-4"))
    fn, args, _, _ = aot.variants(cfg, programs, target)["full"]
    compiled = fn.lower(*args).compile()
    state, tgt, _ = compiled.input_shardings[0]
    named = {**resume.state_leaves(args[0]), **resume.named_leaves(args[1], "target")}
    got = dict(zip(named, jax.tree.leaves(state) + jax.tree.leaves(tgt)))
    mesh = programs.placement.mesh
    checked = 0
    for name, sharding in got.items():
        ndim = len(named[name].shape)
        assert sharding.is_equivalent_to(NamedSharding(mesh, table[name]), ndim), \
            (name, sharding, table[name])
        checked += 1
    assert checked == len(named) > 50


def test_trip_counted_flops_of_a_scan_match_its_size():
    """hlo.Module counts a while body once per iteration (XLA's cost analysis counts it
    once): 8 scanned [64, 512] x [512, 512] matmuls, forward and backward, on 1 and 4 chips."""
    import jax.numpy as jnp

    def f(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0].sum()

    for name, n in (("v5e-1", 1), ("v5e-4", 4)):
        mesh = jax.sharding.Mesh(aot.Topology.parse(name).devices(), ("x",))
        g = jax.jit(jax.grad(f), in_shardings=(NamedSharding(mesh, PartitionSpec()),
                                               NamedSharding(mesh, PartitionSpec("x"))))
        compiled = g.lower(jax.ShapeDtypeStruct((8, 512, 512), jnp.float32),
                           jax.ShapeDtypeStruct((64, 512), jnp.float32)).compile()
        module = hlo.Module(compiled.as_text())
        assert module.dot_flops() == 3 * 8 * 2 * 64 * 512 * 512 / n, name
        # each of the 8 iterations reads its block's weights (1 MiB fp32 / n) at least twice
        assert module.bytes_accessed() >= 8 * 2 * 512 * 512 * 4 / n, name


def test_the_pod_launcher_stops_a_run_that_does_not_fit_before_touching_the_pod(tmp_path):
    """launch/tpu_pod.sh run (a fake gcloud: tests/fake_gcloud) with the REAL local
    `ppgd-tpu compile` as its check: the overflow ends the launch with no ssh, no create."""
    import shutil

    from test_tpu_pod import BASE, Launch

    exe = shutil.which("ppgd-tpu")
    assert exe, "the package's console script is installed with it"
    r = Launch(tmp_path, ["run", "--dry-run", *BASE, "--run_dir", "gs://b/r",
                          "--accelerator-type", "v5e-1", "--", "--config", LM,
                          "--data.batch_size=2048", "--eval.batch_size=8",
                          "--target.llama_simple_mlp.max_seq_len=512", "--mesh.data=1",
                          "--mesh.fsdp=1"], env={"TPU_POD_PPGD_TPU": exe},
               timeout=600)  # a real compile: minutes on a loaded 2-core machine
    assert r.rc == 2, r.err
    assert "ppgd-tpu compile: error: variant full does not compile for v5e-1" in r.err
    assert "the compile check failed (exit 1" in r.err
    assert r.calls == [] and "+ gcloud" not in r.out


def test_a_toy_config_compiles_from_shapes_too(capsys):
    """The embedded default (TMS 5-2: its target's sites are W and W.T) builds from a target
    of ShapeDtypeStructs as well as the LM does."""
    code = cli.run(["compile", "--topology", "v5e-1"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "tms_5-2 on v5e-1: 1 chips" in out and "39/39 state aliased" in out


def test_a_loop_that_steps_its_counter_by_2_runs_half_its_bound():
    """XLA's bidirectional windowed matmuls (seen on v4) count i = 0, 2, 4, 6 < 8: 4 trips.
    A hand-written module in the optimised HLO's text form."""
    text = """HloModule m, input_output_alias={ {}: (0, {}, may-alias) }

%cond (p: (s32[], f32[4,4])) -> pred[] {
  %p = (s32[], f32[4,4]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (q: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %q = (s32[], f32[4,4]) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %x = f32[4,4] get-tuple-element(%q), index=1
  %d = f32[4,4] dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %two = s32[] constant(2)
  %next = s32[] add(%j, %two)
  ROOT %t = (s32[], f32[4,4]) tuple(%next, %d)
}

ENTRY %main (a: f32[4,4]) -> f32[4,4] {
  %a = f32[4,4] parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,4]) tuple(%zero, %a)
  %w = (s32[], f32[4,4]) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4,4] get-tuple-element(%w), index=1
}
"""
    m = hlo.Module(text)
    assert m.multipliers()["body"] == 4 and m.dot_flops() == 4 * 2 * 16 * 4
    assert m.aliased_parameters() == {0}
