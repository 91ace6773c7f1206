"""The mesh from config and the placement rule table (ppgd_tpu/mesh.py), in-process: sizes
and refusals are pure functions of (config, device count), and the placement table is
computed from shapes on an abstract mesh, so nothing here depends on this process's devices.
"""

from pathlib import Path

import pytest

from ppgd_tpu import cli
from ppgd_tpu import config as config_lib
from ppgd_tpu import mesh as mesh_lib
from ppgd_tpu.config import MeshConfig

GOLDEN = Path(__file__).resolve().parent / "golden"


def test_granules_are_slices_on_tpu_and_processes_elsewhere():
    from types import SimpleNamespace as D

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
    (MeshConfig(data=3), 4, 1, "mesh.data, mesh.fsdp = (3, 1) multiply to 3, but there are 4"),
    (MeshConfig(data=-1, fsdp=3), 4, 1, "mesh.fsdp: sizes 3 do not divide the 4"),
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
    cfg = config_lib.load(None, {"data.batch_size": "8", "eval.batch_size": "10"})
    with pytest.raises(mesh_lib.MeshError, match="eval.batch_size: 10"):
        mesh_lib.check_batches(cfg, mesh_lib.abstract_mesh(cfg.mesh, 4))
    mesh_lib.check_batches(cfg, mesh_lib.abstract_mesh(cfg.mesh, 2))  # 2 shards divide both


def test_a_leaf_without_a_rule_is_an_error_naming_it_not_a_silent_replication():
    cfg = config_lib.load(None)
    with pytest.raises(mesh_lib.MeshError, match="'training/new_thing/x' has no placement rule"):
        mesh_lib.logical_axes("training/new_thing/x", 2, cfg, 1)
    # and a rule whose rank does not fit the leaf is refused too
    with pytest.raises(mesh_lib.MeshError, match="gives 2 axes"):
        mesh_lib.logical_axes("decomposition/components/V/linear1", 3, cfg, 1)


def test_a_sharded_dim_that_does_not_divide_is_refused_naming_the_leaf():
    cfg = config_lib.load(None, {"mesh.fsdp_min_elements": "0", "mesh.data": "1",
                                 "mesh.fsdp": "4"})
    p = mesh_lib.Placement(cfg, mesh_lib.abstract_mesh(cfg.mesh, 4), 1)
    assert tuple(p.spec("decomposition/components/V/linear1", (8, 20))[1]) == ("fsdp", None)
    with pytest.raises(mesh_lib.MeshError, match="components/V/linear1'.*size 5 does not divide"):
        p.spec("decomposition/components/V/linear1", (5, 20))


def test_moments_follow_their_parameter_and_small_weights_stay_replicated():
    cfg = config_lib.load(None, {"mesh.fsdp_min_elements": "100", "mesh.data": "1",
                                 "mesh.fsdp": "2"})
    p = mesh_lib.Placement(cfg, mesh_lib.abstract_mesh(cfg.mesh, 2), 1)
    big, small = (64, 4), (8, 4)
    for name in ("decomposition/components/V/s", "training/opt_components/0/mu/V/s",
                 "training/opt_components/0/nu/V/s"):
        assert tuple(p.spec(name, big)[1]) == ("fsdp", None)
        assert tuple(p.spec(name, small)[1]) == (None, None)


@pytest.mark.parametrize("case, devices, processes", [("toy", 4, 1), ("lm", 8, 2)])
def test_placement_table_matches_the_golden_copy(case, devices, processes, capsys):
    """`ppgd-tpu shardings` for the toy and LM configs. To accept a deliberate change:
    ppgd-tpu shardings --config tests/golden/<case>_decomp.yaml --devices D --processes P
    > tests/golden/<case>_shardings.txt"""
    rc = cli.run(["shardings", f"--config={GOLDEN / f'{case}_decomp.yaml'}",
                  f"--devices={devices}", f"--processes={processes}"])
    assert rc == 0
    got = capsys.readouterr().out
    assert got == (GOLDEN / f"{case}_shardings.txt").read_text()
