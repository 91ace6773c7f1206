"""`ppgd-tpu eval`: a committed checkpoint of a run evaluated again, under the run's config
with only its eval fields changed, into RUN_DIR/evals/step_<s> (or --output), reading the
run's files and never changing them."""

import json
import os

import pytest
from conftest import snapshot

from ppgd_tpu import cli

TINY = ["--decomp.steps=40", "--data.batch_size=64", "--eval.batch_size=256", "--eval.every=20",
        "--log.every=10", "--log.progress=false", "--eval.pgd_steps=2",
        "--checkpoint.every=10", "--checkpoint.keep_last_n=4"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    assert cli.run(["train", f"--run_dir={run_dir}", *TINY]) == 0
    return run_dir


def _evals(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, open(run_dir / "metrics.jsonl"))
            if "eval/recon/zero" in r}


def test_eval_of_the_last_checkpoint_repeats_the_final_summary(run, capsys):
    assert not (run / "profile").exists()  # log.profile_start is off by default
    before = snapshot(run, skip=("evals",))
    assert cli.run(["eval", f"--run_dir={run}"]) == 0
    out = run / "evals" / "step_40"
    assert json.load(open(out / "summary.json")) == json.load(open(run / "summary.json"))
    assert sorted(os.listdir(out / "figures")) == sorted(os.listdir(run / "figures"))
    assert (out / "config.yaml").read_text() == (run / "config.yaml").read_text()
    assert f"evaluated step 40 of {run}: {out}/summary.json" in capsys.readouterr().out
    assert snapshot(run, skip=("evals",)) == before  # the run's own files are only read


def test_eval_of_an_earlier_step_repeats_that_steps_eval_line(run):
    assert cli.run(["eval", f"--run_dir={run}", "--step=20", "--eval.figures=false"]) == 0
    out = run / "evals" / "step_20"
    assert json.load(open(out / "summary.json")) == _evals(run)[20]
    assert not (out / "figures").exists()


def test_eval_settings_change_and_are_recorded(run, tmp_path):
    out = tmp_path / "wider"
    assert cli.run(["eval", f"--run_dir={run}", "--step=30", "--eval.batch_size=1024",
                    "--eval.ci_alive_threshold=0.5", "--eval.figures=false",
                    f"--output={out}"]) == 0
    got = json.load(open(out / "summary.json"))
    assert got.keys() == _evals(run)[20].keys() and got["step"] == 30
    assert "batch_size: 1024" in (out / "config.yaml").read_text()
    # a higher threshold counts fewer components active on each input
    ref = tmp_path / "ref"
    assert cli.run(["eval", f"--run_dir={run}", "--step=30", "--eval.batch_size=1024",
                    "--eval.figures=false", f"--output={ref}"]) == 0
    base = json.load(open(ref / "summary.json"))
    assert got["eval/recon/unmasked"] == base["eval/recon/unmasked"]
    assert got["eval/ci_l0/linear1"] < base["eval/ci_l0/linear1"]


@pytest.mark.parametrize("argv,needle", [
    (["--decomp.steps=5"], "--decomp.steps: eval keeps the run's config; the fields it may be "
                           "given are eval.*, data.eval_seed, data.store, target.path, mesh.*"),
    (["--loss.stochastic.new.coeff=1"], "--loss.stochastic.new.coeff: eval keeps the run's"),
    (["--step=7"], "--step: 7 is not a committed checkpoint of {run}; its committed steps: "
                   "10, 20, 30, 40"),
    (["--step=0"], "--step='0': use a whole number >= 1"),
    (["--config=x.yaml"], "--config: eval reads the run's own config"),
    (["--output={run}/summary.json"], "--output: {run}/summary.json exists and is not a "
                                      "directory"),
    (["--eval.batch_size=x"], "eval.batch_size: 'x' is not an integer"),
    # the run's own config.yaml and summary.json were replaced: it then said already complete
    (["--output={run}"], "--output: {run} is a run dir; eval writes config.yaml"),
    (["--output={run}/figures"], "--output: {run}/figures is inside the run dir {run}; eval"),
    (["--output={run}/ckpts/new"], "--output: {run}/ckpts/new is inside the run dir {run}"),
])
def test_refused_eval_flags_exit_2_and_change_nothing(run, capsys, argv, needle):
    before = snapshot(run)
    assert cli.run(["eval", f"--run_dir={run}", *[a.format(run=run) for a in argv]]) == 2
    assert needle.format(run=run) in capsys.readouterr().err
    assert snapshot(run) == before


def test_eval_needs_a_run_with_a_committed_checkpoint(tmp_path, capsys):
    assert cli.run(["eval"]) == 2
    assert "--run_dir: which run to evaluate?" in capsys.readouterr().err
    assert cli.run(["eval", f"--run_dir={tmp_path}"]) == 2
    assert f"--run_dir: {tmp_path} holds no run (no config.yaml)" in capsys.readouterr().err
    run = tmp_path / "stopped"  # started, stopped during the warmup: nothing committed
    run.mkdir()
    (run / "config.yaml").write_text("name: x\n")
    assert cli.run(["eval", f"--run_dir={run}"]) == 2
    assert f"--run_dir: {run} has no committed checkpoint yet" in capsys.readouterr().err


def test_load_run_gives_the_ci_the_runs_eval_measured(run):
    """`ppgd_tpu.load_run`: the components of load_decomposition, and a CI function whose
    CI on the one-hot inputs 0.75 e_i gives the run's own final one-hot metrics."""
    import numpy as np

    import ppgd_tpu
    from ppgd_tpu.eval import identity_ci_error

    got = ppgd_tpu.load_run(str(run))
    assert got.step == 40
    final = ppgd_tpu.load_decomposition(str(run))
    for s in final:
        for part in ("V", "U"):
            np.testing.assert_array_equal(got.components[s][part], final[s][part])
    summary = json.load(open(run / "summary.json"))
    ci = got.ci(0.75 * np.eye(5))
    for s, c in ci.items():
        assert c.shape == (5, 20) and 0 <= c.min() and c.max() <= 1
        assert identity_ci_error(c, 0.1) == summary[f"eval/identity_ci_error/{s}"]
        assert np.mean(np.sum(c > 0.1, -1)) == pytest.approx(summary[f"eval/onehot_ci_l0/{s}"])
    earlier = ppgd_tpu.load_run(str(run), step=20)
    assert earlier.step == 20 and not np.array_equal(earlier.components["linear1"]["V"],
                                                     final["linear1"]["V"])
    with pytest.raises(ValueError, match=r"inputs: expected \[batch, 5\]"):
        got.ci(np.ones((3, 4)))
    with pytest.raises(ValueError, match="step: 7 is not a committed checkpoint"):
        ppgd_tpu.load_run(str(run), step=7)
    with pytest.raises(TypeError, match="step: expected an int .* got '20'"):
        ppgd_tpu.load_run(str(run), step="20")  # read from argv, say
    assert ppgd_tpu.load_run(str(run), step=np.int64(20)).step == 20
