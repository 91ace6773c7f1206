"""`ppgd-tpu report`: the static component browser of a real tiny LM run and a real TMS run,
its statistics checked against the run's own CI function (`ppgd_tpu.load_run`) on the same
rows, and its pages loaded in a real headless Chromium (tests/browser.py), checked from the
rendered DOM."""

import json
import os
import shutil

import jax
import numpy as np
import pytest
from browser import Browser
from conftest import snapshot

import ppgd_tpu
from ppgd_tpu import cli
from ppgd_tpu.data.tokens import TokenStore
from ppgd_tpu.report import scan as scan_lib

no_browser = Browser.missing()
needs_browser = pytest.mark.skipif(no_browser is not None, reason=str(no_browser))

TMS = ["--decomp.steps=40", "--data.batch_size=64", "--eval.batch_size=256", "--eval.every=20",
       "--log.every=10", "--log.progress=false", "--eval.pgd_steps=2", "--checkpoint.every=20"]
TOP_K = 5


def _data(path, name: str):
    text = open(path).read()
    prefix = f"window.{name} = "
    assert text.startswith(prefix) and text.endswith(";\n")
    return json.loads(text[len(prefix):-2])


def _site(out):
    report = _data(out / "data" / "run.js", "REPORT")
    details = [_data(out / s["file"], "REPORT_SITE") for s in report["sites"]]
    return report, details


@pytest.fixture(scope="module")
def lm(corpus, tmp_path_factory):
    """A 20-step decomposition of the tiny LM, its report (the 32 held-out rows), and the
    CI of those rows by load_run: {site: [32, T, C]}."""
    run_dir = tmp_path_factory.mktemp("report_lm") / "run"
    assert cli.run(["train", f"--config={corpus['config']}",
                    f"--target.path={corpus['target']}", f"--data.store={corpus['store']}",
                    f"--run_dir={run_dir}", "--eval.figures=false"]) == 0
    assert cli.run(["report", f"--run_dir={run_dir}", f"--top_k={TOP_K}"]) == 0
    out = run_dir / "report" / "step_20"
    rows = TokenStore.open(corpus["store"]).read_rows(np.arange(32)).astype(np.int32)[:, :-1]
    ci = ppgd_tpu.load_run(str(run_dir)).ci(rows)
    return {"run": run_dir, "out": out, "inputs": rows, "ci": ci}


@pytest.fixture(scope="module")
def tms(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("report_tms") / "run"
    assert cli.run(["train", f"--run_dir={run_dir}", *TMS]) == 0
    assert cli.run(["report", f"--run_dir={run_dir}", "--rows=1000"]) == 0
    return {"run": run_dir, "out": run_dir / "report" / "step_40"}


def _alive(ci: np.ndarray, threshold: float) -> np.ndarray:
    return np.flatnonzero((ci.reshape(-1, ci.shape[-1]) > threshold).any(0))


def test_lm_report_statistics_are_the_runs_ci_on_the_held_out_rows(lm):
    report, details = _site(lm["out"])
    thr = report["threshold"]
    assert report["rows"] == 32 and report["positions"] == 32 * lm["inputs"].shape[1]
    assert report["step"] == 20 and report["complete"]
    assert report["metrics_source"] == "summary.json"
    assert {"eval/ce/clean", "eval/ce/ci_masked", "eval/ce/zero"} <= set(report["metrics"])
    assert report["curves"]["train/loss/total"][-1][0] == 20
    for site, page in zip(report["sites"], details):
        ci = lm["ci"][site["name"]]
        flat = ci.reshape(-1, ci.shape[-1])
        alive = _alive(ci, thr)
        assert len(alive) > 0
        assert [r["c"] for r in site["components"]] == list(alive)
        assert sorted(map(int, page)) == list(alive)
        for row in site["components"]:
            c = row["c"]
            assert row["density"] == pytest.approx(np.mean(flat[:, c] > thr))
            assert row["mean_ci"] == pytest.approx(np.mean(flat[:, c]), rel=1e-4, abs=1e-6)
            assert sum(page[str(c)]["hist"]) == flat.shape[0]
            contexts = page[str(c)]["contexts"]
            assert len(contexts) == TOP_K
            want = np.sort(flat[:, c])[::-1][:TOP_K]
            np.testing.assert_allclose([x["ci"] for x in contexts], want, rtol=1e-4, atol=1e-6)
            for x in contexts:  # the window: the store row's bytes, shaded by this CI
                assert x["ci"] == pytest.approx(ci[x["row"], x["pos"], c], rel=1e-4, abs=1e-6)
                centre = scan_lib.CONTEXT_BEFORE
                assert x["tokens"][centre] == chr(lm["inputs"][x["row"], x["pos"]])
                assert x["cis"][centre] == pytest.approx(x["ci"], abs=1e-4)
                if x["pos"] + 1 < ci.shape[1]:
                    assert x["cis"][centre + 1] == pytest.approx(
                        ci[x["row"], x["pos"] + 1, c], abs=1e-4)


def _rows(b: Browser, site: int) -> list[int]:
    return b.eval(f"[...document.querySelectorAll('#site-{site} tbody tr')]"
                  ".map(r => Number(r.dataset.c))")


@needs_browser
def test_lm_report_renders_in_chromium(lm):
    report, details = _site(lm["out"])
    with Browser() as b:
        b.open((lm["out"] / "index.html").as_uri())
        assert b.eval("document.querySelectorAll('section.site').length") == len(report["sites"])
        for site in report["sites"]:  # one row per alive component, first by density
            shown = _rows(b, site["index"])
            alive = _alive(lm["ci"][site["name"]], report["threshold"])
            assert sorted(shown) == list(alive)
            density = {r["c"]: r["density"] for r in site["components"]}
            assert [density[c] for c in shown] == sorted(density.values(), reverse=True)
        assert b.eval("document.querySelector('table.ce tbody').rows.length") >= 4
        assert b.eval("document.querySelectorAll('#curves svg polyline').length") > 0
        site = report["sites"][0]
        norm = {r["c"]: r["norm"] for r in site["components"]}
        b.click("#site-0 th[data-key=norm]")  # a real click: by norm, largest first
        by_norm = _rows(b, 0)
        assert [norm[c] for c in by_norm] == sorted(norm.values(), reverse=True)
        b.click("#site-0 th[data-key=norm]")  # again: smallest first
        assert _rows(b, 0) == sorted(by_norm, key=lambda c: (norm[c], c))
        c = by_norm[0]
        b.open((lm["out"] / "component.html").as_uri() + f"?site=0&c={c}")
        b.wait_for("document.querySelector('#contexts')")
        contexts = b.eval("[...document.querySelectorAll('li.context')].map(li => "
                          "[li.querySelector('.tok.centre').textContent, "
                          "getComputedStyle(li.querySelector('.tok.centre')).backgroundColor])")
        page = details[0][str(c)]
        assert len(contexts) == TOP_K
        for (text, color), x in zip(contexts, page["contexts"]):
            centre = x["tokens"][scan_lib.CONTEXT_BEFORE]
            assert text == centre.replace("\n", "↵").replace("\t", "→")
            alpha = float(color.rsplit(",", 1)[1].rstrip(")")) if color.count(",") == 3 else 1.0
            # shaded by its CI (Chromium keeps alpha in 8 bits and shows 2 decimals)
            assert alpha == pytest.approx(min(1.0, x["ci"]), abs=0.01)
        assert b.problems == []


@needs_browser
def test_tms_report_renders_in_chromium(tms):
    report, details = _site(tms["out"])
    assert report["kind"] == "toy" and report["rows"] == 1000
    assert len(report["figures"]) == 5 and (tms["out"] / "figures" / "ci_per_feature.png").exists()
    run = ppgd_tpu.load_run(str(tms["run"]))
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), scan_lib.REPORT_TAG), 0)
    rows = np.asarray(run.target.sample(key, 256))  # the scan's first chunk of 256
    onehot = run.ci(0.75 * np.eye(5))
    with Browser() as b:
        b.open((tms["out"] / "index.html").as_uri())
        for site in report["sites"]:
            shown = _rows(b, site["index"])
            assert sorted(shown) == [r["c"] for r in site["components"]]
            # every component on in the first chunk is a row (others may be on later)
            assert set(_alive(run.ci(rows)[site["name"]], report["threshold"])) <= set(shown)
            for r in site["components"]:
                assert r["features"] == list(np.flatnonzero(
                    onehot[site["name"]][:, r["c"]] > report["threshold"]))
        c = report["sites"][0]["components"][0]["c"]
        b.open((tms["out"] / "component.html").as_uri() + f"?site=0&c={c}")
        b.wait_for("document.querySelector('#toy')")
        assert b.eval("document.querySelectorAll('#toy svg')[0].querySelectorAll('rect')"
                      ".length") == 5  # CI on each one-hot input
        assert b.problems == []
    np.testing.assert_allclose(details[0][str(c)]["V"], run.components["linear1"]["V"][:, c],
                               rtol=1e-6)


def test_report_of_a_run_not_finished_reads_its_eval_line_and_only_reads_the_run(tms,
                                                                                   tmp_path):
    """A run stopped after its step-20 checkpoint (as one still training looks): its
    latest checkpoint is reported, with that step's eval line of metrics.jsonl."""
    run = tmp_path / "run"
    shutil.copytree(tms["run"], run, ignore=shutil.ignore_patterns("report"))
    os.remove(run / "summary.json")
    shutil.rmtree(run / "ckpts" / "40")
    before = snapshot(run)
    assert cli.run(["report", f"--run_dir={run}", "--rows=256"]) == 0
    assert snapshot(run, skip=("report",)) == before
    out = run / "report" / "step_20"
    report, _ = _site(out)
    assert report["step"] == 20 and not report["complete"]
    assert report["figures"] == []  # the run's figures would be of its final step
    assert report["metrics_source"].startswith("metrics.jsonl")
    lines = [json.loads(ln) for ln in open(run / "metrics.jsonl")]
    line = [r for r in lines if r["step"] == 20 and "eval/recon/zero" in r][0]
    assert report["metrics"]["eval/recon/zero"] == line["eval/recon/zero"]
    assert max(s for s, _ in report["curves"]["train/loss/total"]) == 20
    # again, into the same dir: replaced whole
    assert cli.run(["report", f"--run_dir={run}", "--rows=128"]) == 0
    assert _site(out)[0]["rows"] == 128
    assert os.listdir(run / "report") == ["step_20"]  # no temporary dir left


@needs_browser
def test_report_to_gcs_opens_once_copied(tms, gcs_emulator, tmp_path):
    from ppgd_tpu import storage

    out = gcs_emulator.run_dir() + "/site"
    assert cli.run(["report", f"--run_dir={tms['run']}", f"--output={out}", "--rows=256"]) == 0
    prefix = out.removeprefix(f"gs://{gcs_emulator.bucket}/") + "/"
    names = [n.removeprefix(prefix) for n in gcs_emulator.names(prefix)]
    assert {"index.html", "component.html", "report.js", "report.css", "data/run.js",
            "report.json"} <= set(names)
    copy = tmp_path / "copy"
    for name in names:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        (copy / name).write_bytes(storage.read_bytes(f"{out}/{name}"))
    report, _ = _site(copy)
    with Browser() as b:
        b.open((copy / "index.html").as_uri())
        for site in report["sites"]:
            assert len(_rows(b, site["index"])) == site["n_alive"] > 0
        assert b.problems == []


@pytest.mark.parametrize("argv, needle", [
    (["--step=7"], "--step: 7 is not a committed checkpoint"),
    (["--rows=0"], "--rows"),
    (["--top_k=-3"], "--top_k"),
    (["--rows=abc"], "--rows"),
])
def test_refused_report_flags_exit_2_and_write_nothing(tms, capsys, argv, needle):
    before = snapshot(tms["run"])
    assert cli.run(["report", f"--run_dir={tms['run']}", *argv]) == 2
    assert needle in capsys.readouterr().err
    assert snapshot(tms["run"]) == before


def test_report_refuses_a_missing_run_and_a_foreign_output(tms, tmp_path, capsys):
    assert cli.run(["report", f"--run_dir={tmp_path / 'none'}"]) == 2
    assert "--run_dir" in capsys.readouterr().err and not (tmp_path / "none").exists()
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    assert cli.run(["report", f"--run_dir={tms['run']}", f"--output={foreign}"]) == 2
    assert "--output" in capsys.readouterr().err
    assert os.listdir(foreign) == ["notes.txt"]


def test_lm_report_refuses_more_rows_than_are_held_out(lm, capsys):
    assert cli.run(["report", f"--run_dir={lm['run']}", "--rows=33"]) == 2
    assert "--rows: 33 exceeds the 32 held-out rows" in capsys.readouterr().err
    assert cli.run(["report", f"--run_dir={lm['run']}", "--top_k=100000"]) == 2
    assert "--top_k" in capsys.readouterr().err
