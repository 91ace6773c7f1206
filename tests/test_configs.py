"""The configs shipped under configs/: each one loads and passes validation, and each
benchmark A/B config differs from its base in exactly the term it measures (a stray field
would make the A/B compare something else)."""

import dataclasses
import pathlib

import pytest

from ppgd_tpu import config
from ppgd_tpu.workspace import RunDir

CONFIGS = pathlib.Path(__file__).resolve().parent.parent / "configs"
SHIPPED = sorted(CONFIGS.rglob("*.yaml"))


def test_the_configs_directory_is_found():
    assert len(SHIPPED) >= 10 and (CONFIGS / "tms_5-2.yaml") in SHIPPED


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_each_shipped_config_validates_and_reads_back_from_its_run_dir(path, tmp_path):
    """A run dir holds the resolved config and a resume is checked against it: it must read
    back as the same config, or resuming a shipped config would be refused."""
    cfg = config.load(str(path))
    run_dir = RunDir(str(tmp_path))
    run_dir.create(cfg, target_sha256="0" * 64)
    assert run_dir.stored_config() == cfg
    run_dir.check_compatible(cfg)


@pytest.mark.parametrize("base", ["tms_5-2_ref", "resid_mlp1_ref"])
def test_a_bench_ppgd_config_is_its_base_plus_one_bsc_term(base):
    plain = config.load(str(CONFIGS / "bench" / f"{base}.yaml"))
    ppgd = config.load(str(CONFIGS / "bench" / f"{base}_ppgd.yaml"))
    (term,) = ppgd.loss.persistent_pgd.values()
    assert (term.scope, term.n_warmup) == ("bsc", 2) and not plain.loss.persistent_pgd
    without = dataclasses.replace(
        ppgd, name=plain.name, loss=dataclasses.replace(ppgd.loss, persistent_pgd={}))
    assert config.to_dict(without) == config.to_dict(plain)


def test_the_embedded_default_is_configs_tms_5_2():
    """README and docs call `tms_5-2` the default of `ppgd-tpu train`: the embedded default
    and the file are the same config, field for field (they had drifted on eval.every)."""
    assert config.to_dict(config.load(None)) == config.to_dict(
        config.load(str(CONFIGS / "tms_5-2.yaml")))


def test_the_default_ties_tms_as_the_paper_and_a_yaml_without_a_tie_ties_nothing():
    """The default decomposes TMS 5-2 tied (linear2's components are linear1's transposed,
    the SPD reference's setup); the untied variant is its own config, which differs from
    the default in the tie alone; and the tie is the embedded default's, not a dataclass
    default that every other YAML (ResidMLP, LMs, untied TMS) would inherit."""
    default = config.load(None)
    untied = config.load(str(CONFIGS / "tms_5-2-untied.yaml"))
    assert default.decomp.tie == {"linear2": "linear1"} and untied.decomp.tie == {}
    same = dataclasses.replace(untied, name=default.name, decomp=dataclasses.replace(
        untied.decomp, tie=default.decomp.tie))
    assert config.to_dict(same) == config.to_dict(default)
    assert config.Config().decomp.tie == {}
    assert config.load(str(CONFIGS / "resid_mlp1.yaml")).decomp.tie == {}
