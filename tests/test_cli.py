"""The CLI contract: bad input exits 2 naming the field, before compute and without touching
an existing run dir; a run writes config.yaml, metrics.jsonl, summary.json and figures."""

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import yaml

from helpers import run_command
from ppgd_tpu import cli, cmdline
from ppgd_tpu import config as config_lib
from ppgd_tpu import load_decomposition
from ppgd_tpu import storage

TINY = ["--decomp.steps=60", "--data.batch_size=64", "--eval.batch_size=256", "--eval.every=30",
        "--log.every=20", "--log.progress=false", "--eval.pgd_steps=2"]


@pytest.mark.parametrize("argv,needle", [
    (["--decomp.stepz=3"], "--decomp.stepz: unknown flag; did you mean --decomp.steps"),
    (["--decomp.steps=abc"], "decomp.steps: 'abc' is not an integer"),
    (["--decomp.steps=1.5"], "decomp.steps: 1.5 is not an integer"),
    (["--loss.imp_min.coeff=x"], "loss.imp_min.coeff: 'x' is not a finite number"),
    (["--loss.imp_min.coeff=nan"], "loss.imp_min.coeff: 'nan' is not a finite number"),
    (["--decomp.lr_ci_fn.value=inf"], "decomp.lr_ci_fn.value: 'inf' is not a finite number"),
    (["--decomp.lr_ci_fn.value=-1e-3"], "decomp.lr_ci_fn.value: -0.001 is out of range; must be >= 0"),
    # [S14] the final ascent divides by coeff; [S15] Adam's bias correction and eps
    (["--loss.persistent_pgd.adv.coeff=0"],
     "loss.persistent_pgd.adv.coeff: 0.0 is out of range; must be > 0"),
    (["--loss.persistent_pgd.adv.beta1=1"],
     "loss.persistent_pgd.adv.beta1: 1.0 is out of range; must be < 1"),
    (["--loss.persistent_pgd.adv.eps=0"],
     "loss.persistent_pgd.adv.eps: 0.0 is out of range; must be > 0"),
    (["--loss.imp_min.eps=0"], "loss.imp_min.eps: 0.0 is out of range; must be > 0"),
    (["--loss.imp_min.kind=smooth_l0", "--loss.imp_min.gamma.kind=linear"],
     "loss.imp_min.gamma: Schedule(kind='linear', value=0.1, warmup_steps=0, final_frac=0.0) "
     "reaches 0"),
    (["--decomp.use_delta=maybe"], "decomp.use_delta: 'maybe' is not a bool; expected true or false"),
    (["--decomp.steps=0"], "decomp.steps: 0 is out of range; must be >= 1"),
    # JAX keys keep 32 bits: 2**32 would be seed 0's run, -1 seed 2**32 - 1's
    (["--seed=4294967296"], "seed: 4294967296 is out of range; must be <= 4294967295"),
    (["--target.seed=-1"], "target.seed: -1 is out of range; must be >= 0"),
    (["--seed=99999999999999999999"], "seed: 99999999999999999999 is out of range"),
    (["--loss.imp_min.kind=l3"], "loss.imp_min.kind: 'l3' is not valid; expected one of 'lp', 'smooth_l0'"),
    (["--data.train_batch_replay=1", "--data.replay_ci_update=first"],
     "data.replay_ci_update: 'first' needs data.train_batch_replay >= 2"),
    (["--data.train_batch_replay=3"], "decomp.steps: 20000 must be a multiple of "
                                      "data.train_batch_replay"),
    (["--loss.imp_min.freq_coeff=0.1"], "loss.imp_min.reference_token_count"),
    (["--decomp.lr_components.kind=linear", "--decomp.lr_components.warmup_steps=20000"],
     "decomp.lr_components.warmup_steps"),
    (["stray"], "unexpected arguments"),
    (["--log.profile_start=20000"], "log.profile_start: 20000 leaves no step to trace "
                                    "(decomp.steps = 20000); use -1 (off) or 0 .. 19999"),
    (["--decomp.sites.linear1=x"], "decomp.sites.linear1: 'x' is not an integer"),
    (["--decomp.sites.lin*=3"], "decomp.sites.lin*: decides no site: each one it matches is "
                                "decided by an exact name or an earlier pattern (linear1 by "
                                "'*', linear2 by '*')"),
    (["--decomp.tie.linear2=linear3"], "decomp.tie.linear2: 'linear3' is not a decomposed site"),
    (["--loss.stochastic.extra.cof=1"], "--loss.stochastic.extra.cof: unknown flag"),
    # a typo of an existing term's name added a second term, silently
    (["--loss.stochastic.stochstic.coeff=0.5"], "--loss.stochastic.stochstic.coeff: "
     "loss.stochastic has no entry 'stochstic'; did you mean "
     "--loss.stochastic.stochastic.coeff?"),
    (["--name=../../elsewhere"], "name: '../../elsewhere' is not a plain name"),
    (["--name="], "name: '' is not a plain name"),
    (["--target.path={tmp}"], "target.path: {tmp} is a directory; expected a safetensors file"),
])
def test_refused_flags_exit_2_with_the_path(argv, needle, capsys, tmp_path):
    argv = [a.format(tmp=tmp_path) for a in argv]
    needle = needle.format(tmp=tmp_path)
    rc, _, err = run_command(["train", f"--run_dir={tmp_path / 'r'}", *argv], capsys)
    assert rc == 2
    assert needle in err
    assert not (tmp_path / "r").exists()  # refused before anything was created


@pytest.mark.parametrize("field,value", [
    ("decomp.steps", "abc"), ("loss.imp_min.coeff", "x"), ("decomp.use_delta", "maybe"),
    ("loss.imp_min.kind", "l3"),
])
def test_a_bad_value_reads_the_same_from_yaml_and_from_a_flag(field, value, capsys, tmp_path):
    """One wording (config.not_a) whichever way the value came in; both exit 2."""
    node = value
    for key in reversed(field.split(".")):
        node = {key: node}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(node))
    rc_yaml, _, from_yaml = run_command(["train", f"--config={tmp_path / 'c.yaml'}"], capsys)
    rc_flag, _, from_flag = run_command(["train", f"--{field}={value}"], capsys)
    assert rc_yaml == rc_flag == 2
    assert from_yaml.strip().splitlines()[-1] == from_flag.strip().splitlines()[-1]
    assert f"{field}: {value!r} is not" in from_flag


@pytest.mark.parametrize("content,needle", [
    (b"name: caf\xe9\n", "is not UTF-8 text (invalid continuation byte at byte 9)"),
    (b"target: {kind: tms, kind: resid_mlp}\n", "key 'kind' appears twice in one mapping"),
    (b"decomp:\n  steps: 10\ndecomp:\n  steps: 20\n", "key 'decomp' appears twice"),
    (b"# all commented out\n", "is empty; leave --config out"),  # ran the embedded default
    (b"a: [1\n", "is not valid YAML (expected ',' or ']', but got '<stream end>' at line 2, "
                 "column 1)"),  # one line, not PyYAML's four
])
def test_a_config_file_that_is_not_one_mapping_of_utf8_exits_2(content, needle, capsys,
                                                               tmp_path):
    """Latin-1 bytes were a UnicodeDecodeError traceback (exit 1, every command); a key
    given twice silently took its last value."""
    (tmp_path / "c.yaml").write_bytes(content)
    for argv in (["train", f"--run_dir={tmp_path / 'r'}"], ["shardings"]):
        rc, _, err = run_command([*argv, f"--config={tmp_path / 'c.yaml'}"], capsys)
        assert rc == 2 and f"--config: {tmp_path / 'c.yaml'} " in err and needle in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("text,want", [("2e4", 20000), ("2.5e3", 2500), ("1_000", 1000),
                                       ("20000", 20000)])
def test_an_integer_field_takes_a_whole_number_written_as_a_float(text, want, tmp_path):
    """`steps: 2e4` is 20000 from YAML (where PyYAML reads it as a string) and from a flag;
    '1.5' and 'abc' stay refused (the tests above)."""
    (tmp_path / "c.yaml").write_text(f"decomp:\n  steps: {text}\n")
    from_yaml, _ = cmdline.parse_config_args([f"--config={tmp_path / 'c.yaml'}"])
    from_flag, _ = cmdline.parse_config_args([f"--decomp.steps={text}"])
    assert from_yaml.decomp.steps == from_flag.decomp.steps == want
    assert type(from_flag.decomp.steps) is int


def test_cross_field_rules_hold_for_the_yaml_and_its_flags_together(tmp_path, capsys):
    """A YAML that is only valid with its flags (`replay_ci_update: first` needs
    train_batch_replay >= 2) is the config the flags make: it was refused on the YAML alone,
    so no flag could fix it; the same rule still refuses the combination."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({"data": {"replay_ci_update": "first"},
                                                     "decomp": {"ci_fn": {"detach_inputs": True}}}))
    cfg, _ = cmdline.parse_config_args([f"--config={tmp_path / 'c.yaml'}",
                                    "--data.train_batch_replay=2"])
    assert (cfg.data.replay_ci_update, cfg.data.train_batch_replay) == ("first", 2)
    rc, _, err = run_command(["train", f"--config={tmp_path / 'c.yaml'}",
                       f"--run_dir={tmp_path / 'r'}"], capsys)
    assert rc == 2 and "data.replay_ci_update: 'first' needs data.train_batch_replay" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("cmd", ["pretrain", "tokenize"])
def test_one_process_commands_refuse_a_multi_process_launch(cmd, capsys, tmp_path,
                                                            monkeypatch):
    """`launch-local -- pretrain` ran N pretrainings into the same files (one crashed on
    the other's renamed log, leaving a stale resume state): refused, naming why."""
    monkeypatch.setenv("PPGD_NUM_PROCESSES", "2")
    rc, _, err = run_command([cmd, f"--output={tmp_path / 'x'}"], capsys)
    assert rc == 2 and f"{cmd} runs as one process" in err and "without launch-local" in err
    assert not list(tmp_path.iterdir())


def test_a_repeated_flag_takes_its_last_value_config_included(tmp_path):
    """absl keeps a repeated flag's last value; --config (read before absl parses) took
    its first, so `--config=a --config=b` ran a's config with b-meant overrides."""
    (tmp_path / "a.yaml").write_text("decomp:\n  steps: 11\n")
    (tmp_path / "b.yaml").write_text("decomp:\n  steps: 22\n")
    cfg, _ = cmdline.parse_config_args([f"--config={tmp_path / 'a.yaml'}", "--config",
                                    str(tmp_path / "b.yaml"), "--seed=1", "--seed=2"])
    assert (cfg.decomp.steps, cfg.seed) == (22, 2)


def test_a_flag_adds_the_mapping_entry_a_yaml_would(tmp_path):
    """`--decomp.tie.linear2=linear1` or a new recon term's field from the command line gives
    the config the same YAML entries give (the term's other fields at their defaults)."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "decomp": {"tie": {"linear2": "linear1"}},
        "loss": {"persistent_pgd": {"adv": {"coeff": 0.5, "lr": {"value": 0.02}}}}}))
    (tmp_path / "base.yaml").write_text("seed: 0\n")  # no tie (the embedded default has one)
    from_yaml, _ = cmdline.parse_config_args([f"--config={tmp_path / 'c.yaml'}"])
    base, _ = cmdline.parse_config_args([f"--config={tmp_path / 'base.yaml'}"])
    from_flags, _ = cmdline.parse_config_args([
        f"--config={tmp_path / 'base.yaml'}", "--decomp.tie.linear2", "linear1",
        "--loss.persistent_pgd.adv.coeff=0.5", "--loss.persistent_pgd.adv.lr.value=0.02"])
    assert base.decomp.tie == {} and not base.loss.persistent_pgd
    assert config_lib.to_dict(from_flags) == config_lib.to_dict(from_yaml)
    assert from_flags.decomp.tie == {"linear2": "linear1"}
    assert from_flags.loss.persistent_pgd["adv"].n_warmup == 0  # the field's default
    # a name that extends an existing one is a new entry, not a typo of it
    more, _ = cmdline.parse_config_args(["--loss.stochastic.stochastic2.coeff=0.5"])
    assert list(more.loss.stochastic) == ["stochastic", "layerwise", "stochastic2"]
    assert more.loss.stochastic["stochastic2"].coeff == 0.5
    # two new ones in one command are not each other's typo
    two, _ = cmdline.parse_config_args(["--loss.persistent_pgd.term_a.coeff=1",
                                    "--loss.persistent_pgd.term_b.coeff=2"])
    assert {n: t.coeff for n, t in two.loss.persistent_pgd.items()} == {"term_a": 1.0,
                                                                       "term_b": 2.0}


def test_a_site_key_with_dots_is_a_flag_like_any_other(tmp_path):
    """ResidMLP sites are named `layers.0.mlp_in`: an entry of that name, from the YAML or
    added by a flag, is overridden whole (not split at its dots)."""
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "target": {"kind": "resid_mlp"}, "decomp": {"sites": {"layers.0.mlp_in": 100}}}))
    cfg, _ = cmdline.parse_config_args([f"--config={tmp_path / 'c.yaml'}",
                                    "--decomp.sites.layers.0.mlp_in=80",
                                    "--decomp.sites.layers.0.mlp_out=60"])
    assert cfg.decomp.sites == {"layers.0.mlp_in": 80, "layers.0.mlp_out": 60}


@pytest.mark.parametrize("argv,needle", [
    (["bench", "step", "--n_steps=abc"], "--n_steps='abc': use a whole number >= 1"),
    (["bench", "step", "--n_steps=0"], "--n_steps='0': use a whole number >= 1"),
    (["bench", "step", "--devices=1,x"], "--devices='1,x': use comma-separated whole numbers"),
    (["bench", "step", "--timing=maybe"], "--timing='maybe': use one of true, false"),
    (["bench", "ckpt", "--n_saves=-2"], "--n_saves='-2': use a whole number >= 1"),
    (["bench", "replay", "--k=two"], "--k='two'"),
    (["bench", "replay", "--k=1"], "--k='1': use a whole number >= 2"),  # named fields unset
    (["shardings", "--processes=0"], "--processes='0'"),
])
def test_refused_command_flags_exit_2_with_the_flag(argv, needle, capsys):
    """A command's own flags (not config fields) are checked the same way, before compute."""
    rc, out, err = run_command(argv, capsys)
    assert rc == 2 and needle in err and not out


def test_refused_yaml_names_the_dotted_path(capsys, tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("decomp:\n  ci_fn:\n    hiden: 3\n")
    rc, _, err = run_command(["train", f"--config={cfg}"], capsys)
    assert rc == 2 and "decomp.ci_fn.hiden: unknown key (did you mean 'hidden'?)" in err
    cfg.write_text("decomp:\n  sites: {mlp_in: 4}\n")
    rc, _, err = run_command(["train", f"--config={cfg}"], capsys)
    assert rc == 2 and "decomp.sites.mlp_in: matches no site" in err and "linear1" in err
    cfg.write_text("decomp:\n  tie: {linear2: linear3}\n")
    rc, _, err = run_command(["train", f"--config={cfg}", f"--run_dir={tmp_path / 'r'}"], capsys)
    assert rc == 2 and "decomp.tie.linear2: 'linear3' is not a decomposed site" in err
    assert not (tmp_path / "r").exists()
    rc, _, err = run_command(["train", f"--config={tmp_path / 'missing.yaml'}"], capsys)
    assert rc == 2 and "--config: no such file" in err
    # a recon term named like another logged loss part, or like a term of another family
    for terms in ["stochastic: {total: {}}", "fresh_pgd: {imp_min: {}}",
                  "persistent_pgd: {stochastic: {}}"]:
        cfg.write_text(f"loss:\n  {terms}\n")
        rc, _, err = run_command(["train", f"--config={cfg}", f"--run_dir={tmp_path / 'r'}"], capsys)
        assert rc == 2 and "recon term names must be unique identifiers" in err, terms
        assert not (tmp_path / "r").exists()


def test_console_script_exit_status_is_2():
    proc = subprocess.run([sys.executable, "-m", "ppgd_tpu.cli", "train", "--eval.every=-1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "eval.every: -1 is out of range" in proc.stderr


def test_version_names_the_package_and_the_libraries_a_result_depends_on(capsys):
    """pyproject.toml is the one place the version is written (tpu_pod.sh reads it too)."""
    import tomllib

    import jax

    import ppgd_tpu

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "pyproject.toml"), "rb") as fh:
        version = tomllib.load(fh)["project"]["version"]
    rc, out, _ = run_command(["--version"], capsys)
    assert rc == 0 and ppgd_tpu.__version__ == version
    assert out.startswith(f"ppgd-tpu {version} ")
    assert f"jax {jax.__version__}," in out and "tensorstore " in out


def test_helpfull_lists_every_field_with_type_default_and_meaning(capsys):
    with pytest.raises(SystemExit) as e:
        cli.run(["train", "--helpfull"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert '--decomp.steps=20000  [int]  optimizer steps' in out
    assert "--loss.stochastic.layerwise.plan=\"chunked\"  [one of 'all', 'chunked']" in out
    assert "--loss.imp_min.p.value=1.0  [float]" in out
    # a mapping's entries are flags (the default ties linear2 to linear1, as
    # configs/tms_5-2.yaml does); the mapping is listed too, empty or not, with its entries
    assert '--decomp.tie.linear2="linear1"  [str]' in out
    assert "  decomp.tie: {<name>: str}  site -> source site" in out
    assert ("  loss.persistent_pgd: {<name>: PersistentPGDTerm {coeff, scope, n_warmup, lr, "
            in out)


@pytest.mark.parametrize("argv,first", [
    (["tokenize"], "usage: ppgd-tpu tokenize"), (["ckpt"], "usage: ppgd-tpu ckpt"),
    (["ckpt", "ls"], "usage: ppgd-tpu ckpt ls"),
    (["launch-local"], "usage: ppgd-tpu launch-local"),
    (["bench"], "usage: ppgd-tpu bench <case>"),
    (["eval"], "flags (a field's default is its value in RUN_DIR/config.yaml):"),
    (["sweep"], "flags (with --config <embedded default>):")])
def test_every_command_answers_helpfull(capsys, argv, first):
    """The top-level usage promises `ppgd-tpu <command> --helpfull` for every command: none
    asks for its required flags or arguments first (tokenize, ckpt and launch-local did when
    they parsed with argparse), nor for a bench case."""
    try:
        rc = cli.run([*argv, "--helpfull"])
    except SystemExit as e:  # the flags library exits after printing the help
        rc = e.code
    assert rc == 0 and capsys.readouterr().out.startswith(first)


def test_helpfull_after_launch_local_separator_is_the_child_commands(capsys):
    """launch-local's own flags end at `--`: a --helpfull after it is the child command's
    (it is not answered with the launcher's usage, and runs nothing here)."""
    with pytest.raises(SystemExit) as e:
        cli.run(["launch-local", "--helpfull", "--", "train", "--helpfull"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: ppgd-tpu launch-local")
    rc, _, err = run_command(["launch-local", "--processes=x", "--", "train", "--helpfull"], capsys)
    assert rc == 2 and "--processes='x': use a whole number >= 1" in err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    assert cli.run(["train", f"--run_dir={run_dir}", *TINY]) == 0
    return run_dir


def test_run_dir_holds_config_metrics_summary_figures(finished_run):
    files = set(os.listdir(finished_run))
    assert {"target.json", "config.yaml", "metrics.jsonl", "summary.json", "figures",
            "decomposition.safetensors"} <= files
    rows = [json.loads(ln) for ln in open(finished_run / "metrics.jsonl")]
    train = [r for r in rows if "train/loss/total" in r]
    assert [r["step"] for r in train] == [20, 40, 60]
    for key in ["train/loss/total", "train/loss/faithfulness", "train/loss/imp_min",
                "train/loss/stochastic", "train/loss/layerwise",
                "train/grad_norms/summary/components", "train/grad_norms/summary/ci_fn",
                "train/grad_norms/summary/total", "train/lr/components", "train/lr/ci_fn",
                "train/perf/step_time_s"]:
        assert all(np.isfinite(r[key]) for r in train), key
    evals = [r for r in rows if "eval/recon/zero" in r]
    assert [r["step"] for r in evals] == [30, 60]
    summary = json.load(open(finished_run / "summary.json"))
    for key in ["eval/ci_l0/linear1", "eval/alive/linear2", "eval/identity_ci_error/linear1",
                "eval/mmcs/linear1", "eval/onehot_ci_l0/linear2", "eval/recon/unmasked",
                "eval/recon/ci_masked", "eval/recon/stochastic", "eval/recon/pgd",
                "eval/recon/zero"]:
        assert key in summary, key
    assert summary["eval/recon/zero"] > summary["eval/recon/unmasked"]
    figs = set(os.listdir(finished_run / "figures"))
    assert {"ci_per_feature.png", "component_weights.png", "ci_histograms.png"} <= figs


def test_step_time_leaves_out_the_compiles_which_compile_s_shows(finished_run):
    """The first window compiles the step, the one after the first eval (step 30) the eval:
    `compile_s` reports those seconds and `step_time_s` excludes them (it used to spread the
    compile over the window's steps); no window after that compiles anything."""
    train = [r for r in map(json.loads, open(finished_run / "metrics.jsonl"))
             if "train/loss/total" in r]
    first, after_eval, last = train
    for r in (first, after_eval):
        assert r["train/perf/compile_s"] > 20 * r["train/perf/step_time_s"] > 0, r
    assert last["train/perf/compile_s"] == 0.0
    assert last["train/perf/step_time_s"] > 0
    # the eval at step 30 falls in the window of step 40: its time is set aside as well
    assert [r["train/perf/eval_and_save_s"] > 0 for r in train] == [False, True, False]
    for r in train:  # the global batch's rows per second (no tokens: TMS has no positions)
        assert r["train/perf/examples_per_s"] == pytest.approx(64 / r["train/perf/step_time_s"])
        assert "train/perf/tokens_per_s" not in r


@pytest.mark.parametrize("name,n_layers,d_mlp", [("resid_mlp1", 1, 50), ("resid_mlp2", 2, 25)])
def test_resid_mlp_config_trains_its_target_and_reports_its_site_metrics(tmp_path, name,
                                                                          n_layers, d_mlp):
    """configs/resid_mlp{1,2}.yaml end to end, briefly: the target is trained, validated and
    decomposed, and each layer's sites get the one-hot metrics of their ground truth - the
    identity on every mlp_in, one rank-d_mlp mechanism on every mlp_out, whose input units
    are neurons."""
    run_dir = tmp_path / "resid"
    assert cli.run(["train", f"--config=configs/{name}.yaml", f"--run_dir={run_dir}",
                    *TINY, "--eval.figures=false"]) == 0
    s = json.load(open(run_dir / "summary.json"))
    d = load_decomposition(str(run_dir))
    assert len(d) == 2 * n_layers
    for i in range(n_layers):
        mlp_in, mlp_out = f"layers.{i}.mlp_in", f"layers.{i}.mlp_out"
        assert s[f"eval/identity_ci_error/{mlp_in}"] >= 0
        assert s[f"eval/dense_ci_error/{mlp_out}"] >= 0
        assert 0.0 < s[f"eval/neuron_alignment/{mlp_out}"] <= 1.0
        for key in (f"identity_ci_error/{mlp_out}", f"dense_ci_error/{mlp_in}",
                    f"neuron_alignment/{mlp_in}", f"mmcs/{mlp_out}"):
            assert f"eval/{key}" not in s, key
        assert d[mlp_out]["V"].shape[0] == d[mlp_in]["U"].shape[1] == d_mlp


@pytest.mark.parametrize("cadence,needle", [
    (["--log.every=10", "--eval.every=0"], "step 10: train/loss/faithfulness = nan"),
    (["--log.every=20", "--eval.every=10"], "step 10: eval/faithfulness = nan"),
    (["--log.every=20", "--eval.every=0", "--checkpoint.every=10"],  # it committed nan
     "step 10: the components or the CI fn have non-finite values"),
])
def test_a_diverged_run_stops_with_status_1_at_the_step_it_saw_it(tmp_path, capsys, cadence,
                                                                     needle):
    """An lr that blows the components up: the first log (or eval) step that sees a
    non-finite value, or save that would store one, stops the run with status 1 naming the
    step and the values; what was written stays (metrics.jsonl with that line, strict JSON:
    the non-finite values as null), nothing is marked complete or saved after it."""
    run_dir = tmp_path / "nan"
    rc, _, err = run_command(["train", f"--run_dir={run_dir}", *TINY, *cadence, "--decomp.steps=40",
                       "--decomp.lr_components.value=1e30", "--eval.figures=false"], capsys)
    assert rc == 1
    assert f"ppgd-tpu train: error: {run_dir}: {needle}" in err and "diverged" in err
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(ln, parse_constant=pytest.fail) for ln in open(metrics)
            ] if metrics.exists() else []
    assert [r["step"] for r in rows] == ([10] if "train" in needle else [])
    assert all(r["train/loss/faithfulness"] is None for r in rows)
    assert not (run_dir / "summary.json").exists()
    assert not (run_dir / "ckpts").exists() or not os.listdir(run_dir / "ckpts")


def _signal_when(cmd, env, ready, signum, after_s=0.0, cwd=None):
    """Runs `cmd`; sends `signum` `after_s` seconds after the first stderr line for which
    `ready(line)` holds; returns (returncode, stdout, stderr lines).

    The child runs at most one page of stderr past that line before the signal, however late
    this process gets the CPU: its stderr pipe is shrunk to one page, and read a byte at a
    time so that nothing past the line sits unread here. (With the default 64 KiB pipe and a
    buffered read, a child under load once got ~90 KB of `-X importtime` lines past the
    line, out of its imports and into the loop, before the signal came.)"""
    # SIGINT as a terminal sends it: a shell's background job (CI run with `&`) starts its
    # children with SIGINT ignored, and Python then leaves it ignored; a signal the parent
    # handles is reset to the default in the child
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, os.sysconf("SC_PAGE_SIZE"))
    with open(read_end, "rb", buffering=0) as stderr:  # unbuffered: one byte per read
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            p = subprocess.Popen(cmd, stderr=write_end, stdout=subprocess.PIPE, env=env, cwd=cwd)
        finally:
            signal.signal(signal.SIGINT, previous)
            os.close(write_end)
        err = []
        try:
            for line in iter(stderr.readline, b""):
                err.append(line.decode())
                if ready(err[-1]):
                    time.sleep(after_s)
                    p.send_signal(signum)
                    break
            rest = []  # the rest of stderr, read beside communicate's stdout
            reader = threading.Thread(target=lambda: rest.append(stderr.read()))
            reader.start()
            out = p.communicate(timeout=300)[0]
            reader.join()
        finally:
            if p.poll() is None:
                p.kill()
    return p.returncode, out.decode(), "".join(err + [rest[0].decode()]).splitlines()


@pytest.mark.parametrize("given", [True, False])
def test_ctrl_c_before_the_loop_exits_130_without_a_traceback(tmp_path, given):
    """A real SIGINT while the toy target trains (before the loop, whose own stop handling
    is tested in test_resume.py): exit 130 with one line, no traceback, no run dir made.
    Without --run_dir the line names the dir it chose: the same command would choose a
    new one."""
    run_dir = tmp_path / "r"
    cmd = [sys.executable, "-m", "ppgd_tpu.cli", "train", "--target.tms.train_steps=200000",
           "--log.progress=false", *([f"--run_dir={run_dir}"] if given else [])]
    env = {**os.environ, "PPGD_TPU_CACHE": str(tmp_path / "cache"),
           "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    # the mesh is made just before the target is built
    rc, _, err = _signal_when(cmd, env, lambda line: "mesh {" in line, signal.SIGINT,
                              cwd=tmp_path)
    assert rc == 130, err
    assert "interrupted" in err[-1] and "Traceback" not in "\n".join(err), err
    assert ("with --run_dir=runs/tms_5-2-" in err[-1]) != given, err[-1]
    assert not run_dir.exists() and not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name,after", [
    ("SIGINT", "numpy._core._multiarray_umath"), ("SIGTERM", "numpy._core._multiarray_umath"),
    ("SIGINT", "jaxlib.mlir._mlir_libs._mlir"), ("SIGTERM", "jax._src.lib"),
    ("SIGINT", "tensorstore")])
def test_a_signal_during_the_imports_exits_with_one_line(tmp_path, name, after):
    """A real signal sent while the CLI still imports (`-X importtime` reports each import as
    it finishes; the one around it is still running): exit 130/143 with one line. Raised
    inside an import it used to print a traceback, come out as an ImportError (exit 1) or
    abort the process; raised in JAX's gc callback it was ignored and the run went on."""
    run_dir = tmp_path / "r"
    cmd = [sys.executable, "-X", "importtime", "-m", "ppgd_tpu", "train",
           f"--run_dir={run_dir}", "--log.progress=false"]
    env = {**os.environ, "PPGD_TPU_CACHE": str(tmp_path / "cache")}
    rc, _, err = _signal_when(
        cmd, env, lambda line: line.startswith("import time:") and
        line.split("|")[-1].strip() == after, getattr(signal, name))
    err = [ln for ln in err if not ln.startswith("import time:")]
    assert rc == (143 if name == "SIGTERM" else 130), err
    assert len(err) == 1 and err[0].startswith("ppgd-tpu: ") and name in err[0], err
    assert not run_dir.exists()


def test_C5_a_stop_during_the_faithfulness_warmup_ends_it_and_saves_nothing(tmp_path):
    """A real SIGTERM 2 s into a warmup of 3e8 steps (~20 min on 2 cores, one dispatch per
    1000 steps): the run stops at the next part, long before the warmup would end (whose
    end is logged), exits 0 and saves nothing. (Once the warmup was one dispatch, and the
    loop saw the signal only after it: with step 1, which it then saved.)"""
    run_dir = tmp_path / "r"
    cmd = [sys.executable, "-m", "ppgd_tpu", "train", f"--run_dir={run_dir}",
           "--decomp.faithfulness_warmup_steps=300000000", "--decomp.steps=20",
           "--log.every=10", "--eval.every=0", "--eval.figures=false", "--log.progress=false"]
    env = {**os.environ, "PPGD_TPU_CACHE": str(tmp_path / "cache")}
    rc, out, err = _signal_when(cmd, env, lambda line: "run dir" in line, signal.SIGTERM,
                                after_s=2.0)
    assert rc == 0, err
    assert "during faithfulness warmup; nothing was saved" in out, (out, err)
    assert not any("faithfulness warmup (" in line for line in err), err  # it never ended
    assert not (run_dir / "ckpts").exists() or not os.listdir(run_dir / "ckpts")
    assert not (run_dir / "metrics.jsonl").exists()


def test_load_decomposition_returns_numpy_components(finished_run, monkeypatch):
    d = load_decomposition(str(finished_run))
    assert set(d) == {"linear1", "linear2"}
    assert d["linear1"]["V"].shape == (5, 20) and d["linear1"]["U"].shape == (20, 2)
    assert d["linear2"]["V"].shape == (2, 20) and d["linear2"]["U"].shape == (20, 5)
    # a pathlib.Path (an AttributeError) and `~` (said 'is a file') name the same run
    monkeypatch.setenv("HOME", str(finished_run.parent))
    for same in (finished_run, f"~/{finished_run.name}"):
        again = load_decomposition(same)
        assert all((again[s][p] == d[s][p]).all() for s in d for p in ("V", "U"))


def test_load_decomposition_names_a_damaged_file(finished_run, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(finished_run, run)
    path = run / "decomposition.safetensors"
    path.write_bytes(path.read_bytes()[:100])  # cut short, as a full disk would leave it
    with pytest.raises(ValueError, match=f"{path} is not a readable safetensors file"):
        load_decomposition(str(run))


def test_load_decomposition_names_a_path_that_is_no_run_dir(tmp_path):
    """It said 'no decomposition yet' of a path that does not exist or is a file."""
    with pytest.raises(FileNotFoundError, match=f"{tmp_path / 'nope'}: no such run directory"):
        load_decomposition(str(tmp_path / "nope"))
    (tmp_path / "f").write_text("")
    with pytest.raises(NotADirectoryError, match="is a file, not a run directory"):
        load_decomposition(str(tmp_path / "f"))


def test_rerun_complete_and_refused_resume_leave_the_dir_untouched(finished_run, capsys):
    before = {f: open(finished_run / f, "rb").read()
              for f in ["target.json", "config.yaml", "metrics.jsonl", "summary.json"]}
    rc, out, _ = run_command(["train", f"--run_dir={finished_run}", *TINY], capsys)
    assert rc == 0 and "already complete" in out
    rc, _, err = run_command(["train", f"--run_dir={finished_run}", *TINY,
                       "--loss.imp_min.coeff=0.5"], capsys)
    assert rc == 2 and "loss.imp_min.coeff: 0.003 -> 0.5" in err
    assert "no checkpoint yet" not in err
    # fields that do not change the trajectory may differ (WORKSPACE.md)
    rc, out, _ = run_command(["train", f"--run_dir={finished_run}", *TINY, "--log.every=5"], capsys)
    assert rc == 0 and "already complete" in out
    after = {f: open(finished_run / f, "rb").read() for f in before}
    assert before == after


def test_a_refused_run_that_never_checkpointed_says_it_may_be_started_over(finished_run,
                                                                            tmp_path, capsys):
    """A run that died before its first checkpoint (e.g. out of memory at its first step)
    keeps its config like any other; the refusal says removing it loses no checkpoint."""
    run = tmp_path / "r"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "ckpts")
    (run / "summary.json").unlink()
    rc, _, err = run_command(["train", f"--run_dir={run}", *TINY, "--loss.imp_min.coeff=0.5"], capsys)
    assert rc == 2 and "loss.imp_min.coeff: 0.003 -> 0.5" in err
    assert f"that run has no checkpoint yet: to start it over with this config, remove {run}" \
        in err


def test_a_summary_that_is_a_directory_is_refused_naming_it(finished_run, tmp_path, capsys):
    run = tmp_path / "r"
    shutil.copytree(finished_run, run)
    (run / "summary.json").unlink()
    (run / "summary.json").mkdir()
    rc, out, err = run_command(["train", f"--run_dir={run}", *TINY], capsys)
    assert rc == 2 and f"{run / 'summary.json'} is a directory" in err, err
    assert "already complete" not in out


def test_a_summary_changed_by_hand_is_refused_not_read(finished_run, tmp_path, capsys):
    run = tmp_path / "r"
    shutil.copytree(finished_run, run)
    (run / "summary.json").write_text('{"step": 6')
    rc, out, err = run_command(["train", f"--run_dir={run}", *TINY], capsys)
    assert rc == 2 and "summary.json marks this run complete but is not valid JSON" in err
    assert "already complete" not in out and (run / "summary.json").read_text() == '{"step": 6'


def test_pretrain_writes_a_target_that_train_loads_and_bad_files_are_refused(tmp_path, capsys):
    out = tmp_path / "tms.safetensors"
    rc, text, _ = run_command(["pretrain", f"--output={out}", "--target.tms.train_steps=3000"], capsys)
    assert rc == 0 and out.exists()
    written = out.read_bytes()
    # the same again: nothing to do (it is deterministic); another config: replaced, said
    rc, text, _ = run_command(["pretrain", f"--output={out}", "--target.tms.train_steps=3000",
                        "--target.resid_mlp.d_mlp=7"], capsys)  # another kind's field
    assert rc == 0 and f"{out}: already complete" in text and out.read_bytes() == written
    rc, text, _ = run_command(["pretrain", f"--output={out}", "--target.tms.train_steps=3001"], capsys)
    assert rc == 0 and (f"{out} holds a target pretrained otherwise (target.tms.train_steps: "
                        "3000 there, 3001 here)") in text
    assert out.read_bytes() != written
    from safetensors.numpy import load_file, save_file

    sd = load_file(str(out))
    assert set(sd) == {"W", "b"}
    save_file({"W": sd["W"][:, :1], "b": sd["b"]}, str(tmp_path / "bad.safetensors"))
    rc, _, err = run_command(["train", f"--target.path={tmp_path / 'bad.safetensors'}",
                       f"--run_dir={tmp_path / 'r'}", *TINY], capsys)
    assert rc == 2 and "tensor 'W' has shape (5, 1), expected (5, 2)" in err
    save_file({"W": sd["W"]}, str(tmp_path / "missing.safetensors"))
    rc, _, err = run_command(["train", f"--target.path={tmp_path / 'missing.safetensors'}",
                       f"--run_dir={tmp_path / 'r'}", *TINY], capsys)
    assert rc == 2 and "missing tensor 'b'" in err
    rc, _, _ = run_command(["train", f"--target.path={out}", f"--run_dir={tmp_path / 'ok'}", *TINY],
                    capsys)
    assert rc == 0


def _files(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_resume_rebuilds_the_same_target_or_is_refused_C1(tmp_path, capsys):
    """[C1] the frozen target is rebuilt, not stored, so the run records its weights'
    sha256 (target.json): a resume onto other weights (the file overwritten by another
    pretrain) is refused, exit 2, nothing touched; the same weights at another path resume."""
    t, copy, run = tmp_path / "t.safetensors", tmp_path / "copy.safetensors", tmp_path / "r"
    assert run_command(["pretrain", f"--output={t}"], capsys)[0] == 0
    shutil.copy(t, copy)
    assert run_command(["train", f"--target.path={t}", f"--run_dir={run}", *TINY], capsys)[0] == 0
    started = json.loads((run / "target.json").read_text())
    assert started["path"] == str(t) and len(started["sha256"]) == 64
    (run / "summary.json").unlink()  # stopped after its last checkpoint: resumable

    assert run_command(["pretrain", f"--output={t}", "--target.seed=1"], capsys)[0] == 0
    before = _files(run)
    rc, _, err = run_command(["train", f"--target.path={t}", f"--run_dir={run}", *TINY], capsys)
    assert rc == 2 and f"target: the weights now at {t} differ from those" in err, err
    assert _files(run) == before

    rc, _, err = run_command(["train", f"--target.path={copy}", f"--run_dir={run}", *TINY], capsys)
    assert rc == 0, err
    assert json.loads((run / "summary.json").read_text())["step"] == 60
    assert json.loads((run / "target.json").read_text()) == started  # written once

    (run / "summary.json").unlink()
    (run / "target.json").write_text('{"sha256": ')  # changed by hand
    rc, _, err = run_command(["train", f"--target.path={t}", f"--run_dir={run}", *TINY], capsys)
    assert rc == 2 and "target.json is not the record this package writes" in err, err

    # A run dir from before target.json: the weights go unchecked, and target.path may not
    # move (it is then the only identity of the target).
    (run / "target.json").unlink()
    rc, _, err = run_command(["train", f"--target.path={copy}", f"--run_dir={run}", *TINY], capsys)
    assert rc == 2 and f"target.path: '{t}' -> '{copy}'" in err, err
    assert run_command(["train", f"--target.path={t}", f"--run_dir={run}", *TINY], capsys)[0] == 0


def test_unwritable_paths_are_refused_before_any_compute(tmp_path, capsys, monkeypatch):
    """A run dir or target output that could not be written exits 2 naming the flag, before
    a target is trained (an empty cache stays empty) and without touching what is there."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("PPGD_TPU_CACHE", str(cache))
    afile = tmp_path / "afile"
    afile.write_text("keep")
    notes = tmp_path / "notes.md"  # 8 bytes or more of text: once read as a header length
    notes.write_text("a README that is no safetensors file\n")
    for argv, needle in [
            (["train", f"--run_dir={afile}"], f"--run_dir: {afile} exists and is not a directory"),
            (["train", f"--run_dir={afile / 'r'}"], f"--run_dir: {afile} is a file, so"),
            (["train", "--run_dir=/proc/ppgd-tpu/r"],  # said: cannot open .../.lock
             "--run_dir: /proc/ppgd-tpu/r cannot be created: /proc takes no new entries"),
            (["pretrain", f"--output={afile / 't.safetensors'}"], f"--output: {afile} is a file"),
            (["pretrain", f"--output={tmp_path}"], f"--output: {tmp_path} exists and is not a file"),
            (["pretrain", f"--output={tmp_path / 'new'}/"], f"--output: {tmp_path / 'new'}/ ends "
             "with '/', so it names a directory"),
            (["pretrain", "--store=s"], "--store: only an LM target trains on a token store"),
            (["pretrain", f"--output={afile}"],  # someone's file: it was overwritten
             f"--output: {afile} exists and is not a target `pretrain` wrote"),
            (["pretrain", f"--output={notes}"],
             f"--output: {notes} exists and is not a target `pretrain` wrote"),
            (["train", f"--config={tmp_path}"], f"--config: cannot read '{tmp_path}'")]:
        rc, _, err = run_command([*argv, "--target.seed=7", *TINY], capsys)
        assert rc == 2 and needle in err, (argv, err)
    assert afile.read_text() == "keep" and not cache.exists()
    assert notes.read_text() == "a README that is no safetensors file\n"
    assert sorted(os.listdir(tmp_path)) == ["afile", "notes.md"]


def test_a_target_that_fails_validation_is_refused(tmp_path, capsys):
    rc, _, err = run_command(["train", "--target.tms.train_steps=5", f"--run_dir={tmp_path / 'r'}",
                       *TINY], capsys)
    assert rc == 2 and "failed validation" in err and "x_hat_i" in err
    assert not (tmp_path / "r").exists()


def test_the_progress_bar_shows_the_loss_of_the_step_it_reaches(capsys):
    """Each log step's update shows that step's loss (it used to show the previous log
    step's: the postfix was set after the update had already refreshed the bar)."""
    from ppgd_tpu.metrics import Progress

    bar = Progress(total=30, initial=0, enabled=True)
    bar.bar.mininterval = 0  # refresh on every update
    for step, loss in ((10, 1.0), (20, 2.0), (30, 3.0)):
        bar.update(10, loss)
        shown = capsys.readouterr().err.split("\r")[-1]
        assert f"{step}/30" in shown and f"loss={loss:.3e}" in shown, shown
    bar.close()


def test_help_into_a_pipe_that_closes_ends_quietly():
    """`ppgd-tpu train --helpfull | head -1`: no BrokenPipeError traceback, exit 141."""
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write: every write fails
    try:
        p = subprocess.run([sys.executable, "-m", "ppgd_tpu", "train", "--helpfull"],
                           stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert p.returncode == 141, p.stderr
    assert p.stderr == ""


def test_a_run_dir_under_tilde_is_under_home(monkeypatch, tmp_path):
    """`--run_dir=~/x` reaches no shell expansion (it follows `=`): expanded here."""
    monkeypatch.setenv("HOME", str(tmp_path))
    assert storage.normalize("~/runs/x") == str(tmp_path / "runs" / "x")


@pytest.mark.parametrize("mode,groups", [
    ("every", set()), ("first", {"envelope"}), ("mean", {"envelope", "accumulator"})])
def test_shardings_lists_the_replay_window_leaves_a_mode_holds(capsys, mode, groups):
    k = "1" if mode == "every" else "2"
    assert cli.run(["shardings", f"--data.train_batch_replay={k}",
                    f"--data.replay_ci_update={mode}", "--decomp.ci_fn.kind=per_site_mlp",
                    "--decomp.ci_fn.detach_inputs=true"]) == 0
    listed = {line.split("/")[2] for line in capsys.readouterr().out.splitlines()
              if line.startswith("training/replay/")}
    assert listed == groups
