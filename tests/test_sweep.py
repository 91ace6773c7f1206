"""`ppgd-tpu sweep`: one `train` per seed (subprocesses), a table and sweep.json of what each
recovered, resumable (a finished seed is not trained again), a failed seed reported and
exit 1, a bad --seeds exit 2 before anything runs."""

import json
import os
import time

import pytest

from ppgd_tpu import cli, sweep

TINY = ["--config=configs/tms_5-2.yaml", "--decomp.steps=40", "--data.batch_size=64",
        "--eval.batch_size=256", "--eval.every=0", "--eval.figures=false", "--eval.pgd_steps=2",
        "--log.every=20", "--log.progress=false", "--log.tensorboard=false"]


def _files(root):
    """{path: (size, mtime_ns)} of every file under root."""
    out = {}
    for here, _, names in os.walk(root):
        for n in names:
            st = os.stat(os.path.join(here, n))
            out[os.path.join(here, n)] = (st.st_size, st.st_mtime_ns)
    return out


def test_sweep_tables_each_seed_resumes_and_reports_a_failed_one(tmp_path, capsys):
    out = tmp_path / "sw"
    start = time.time()
    assert cli.run(["sweep", *TINY, "--seeds", "0-1", "--jobs", "2", f"--output={out}"]) == 0
    first_s = time.time() - start
    printed = capsys.readouterr().out
    result = json.load(open(out / "sweep.json"))
    assert [r["seed"] for r in result["rows"]] == [0, 1]
    for r in result["rows"]:  # each row is its run's summary.json, trained at its own seed
        run = out / f"seed_{r['seed']}"
        summary = json.load(open(run / "summary.json"))
        assert r["exit"] == 0 and not r["skipped"]
        assert r["summary"] == sweep.summary_row(summary) and r["summary"]
        assert {"eval/recovered/linear1", "eval/alive/linear2", "eval/mmcs/linear1",
                "eval/alive_sum_rel_error/linear1"} <= set(r["summary"])
        assert f"seed: {r['seed']}\n" in (run / "config.yaml").read_text()
        cells = [ln.split() for ln in printed.splitlines() if ln.split()[:2] == [
            str(r["seed"]), "0"]]
        assert len(cells) == 1 and str(summary["eval/alive/linear2"]) in cells[0]
    # the rates count the rows' own verdicts
    for site in ("linear1", "linear2"):
        k = sum(r["summary"][f"eval/recovered/{site}"] == 1 for r in result["rows"])
        assert result["rates"][site]["recovered"] == k and result["rates"][site]["of"] == 2
        assert f"{site}: recovered at {k} of 2 seeds" in printed
    assert "all sites: recovered at" in printed

    # the same command again: both seeds are complete, nothing is trained or rewritten
    before = _files(out / "seed_0") | _files(out / "seed_1")
    start = time.time()
    assert cli.run(["sweep", *TINY, "--seeds", "0-1", "--jobs", "2", f"--output={out}"]) == 0
    again_s = time.time() - start
    printed = capsys.readouterr().out
    assert _files(out / "seed_0") | _files(out / "seed_1") == before
    assert printed.count("already complete") == 2 and "training in" not in printed
    assert again_s < first_s / 2, (again_s, first_s)
    assert [r["skipped"] for r in json.load(open(out / "sweep.json"))["rows"]] == [True, True]

    # a seed whose train fails (here refused: its run dir holds a stray file) is a row with
    # its exit status; the finished ones are still tabled, and the sweep exits 1
    (out / "seed_2").mkdir()
    (out / "seed_2" / "stray.txt").write_text("not a run")
    assert cli.run(["sweep", *TINY, "--seeds", "0-2", f"--output={out}"]) == 1
    printed = capsys.readouterr().out
    rows = json.load(open(out / "sweep.json"))["rows"]
    assert [(r["seed"], r["exit"]) for r in rows] == [(0, 0), (1, 0), (2, 2)]
    assert rows[2]["summary"] == {} and "failed (no summary): seeds 2" in printed
    assert "is not empty" in (out / "logs" / "seed_2.log").read_text()
    assert "of 3 seeds" in printed


@pytest.mark.parametrize("seeds,needle", [
    ("5-2", "'5-2' is an empty range"), ("0,x", "'x' is not a seed or a range"),
    ("", "which seeds?"), ("-1", "'-1' is not a seed"), ("1-99999999999", "above the largest")])
def test_a_bad_seeds_value_exits_2_naming_the_flag_before_anything_runs(tmp_path, capsys,
                                                                         seeds, needle):
    out = tmp_path / "sw"
    assert cli.run(["sweep", *TINY, f"--seeds={seeds}", f"--output={out}"]) == 2
    err = capsys.readouterr().err
    assert f"ppgd-tpu sweep: error: --seeds='{seeds}': " in err and needle in err, err
    assert not out.exists()


def test_seeds_parse_ranges_and_lists_and_the_sweeps_own_flags_reach_no_train():
    assert sweep.parse_seeds("0-3,8,2,10-11") == [0, 1, 2, 3, 8, 10, 11]
    assert sweep.parse_seeds(" 7 ") == [7]
    assert sweep._train_args(["--seeds", "0-3", "--jobs=2", "--config", "c.yaml",
                              "--output", "o", "--decomp.steps=5"]) == [
        "--config=c.yaml", "--decomp.steps=5"]


@pytest.mark.parametrize("flag", ["--seed=3", "--run_dir=r", "--decomp.stepz=3"])
def test_a_flag_train_would_refuse_or_the_sweep_sets_exits_2(tmp_path, capsys, flag):
    out = tmp_path / "sw"
    assert cli.run(["sweep", *TINY, "--seeds=0", f"--output={out}", flag]) == 2
    assert f"error: --{flag[2:].split('=')[0]}" in capsys.readouterr().err
    assert not out.exists()
