"""The bench commands run and report their numbers. Timings live in benchmarks, not tests:
no timing is compared with another measured one. What is asserted holds by construction in
bench.py: values finite and positive, shares in [0, 1], each derived number consistent with
the ones it is computed from, and the byte counts equal to ones the test computes itself."""

import json
import math
import os
import re
import resource
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppgd_tpu import cli, cmdline
from ppgd_tpu import config as config_lib
from ppgd_tpu.engine import Trainer

TINY = ["--data.batch_size=64", "--decomp.steps=40", "--eval.batch_size=64"]
PRINTED = 2e-3  # bench prints floats as `.4g`: each within 5e-4 relative of its value


def _report(out: str) -> dict[str, str]:
    return dict(ln.split(None, 1) for ln in out.splitlines() if ln.strip())


def _floats(report: dict, keys) -> dict[str, float]:
    vals = {k: float(report[k]) for k in keys}
    assert all(math.isfinite(v) for v in vals.values()), vals
    return vals


def _live_rows_bound(rows, tms_cfg):
    """live_rows.sizes' documented rule, by hand: a row is live unless all n_features are
    off, p = 1 - (1 - feature_probability)^n_features; the bound is the binomial mean
    rows p + 6 sd sqrt(rows p (1 - p)), rounded up to a multiple of 8 (a live-rows branch
    exists only while that is at most half the batch)."""
    p = 1.0 - (1.0 - tms_cfg.feature_probability) ** tms_cfg.n_features
    mean, sd = rows * p, math.sqrt(rows * p * (1.0 - p))
    return 8 * math.ceil((mean + 6.0 * sd) / 8)


def test_bench_step_reports_step_time_and_host_overhead(capsys):
    assert cli.run(["bench", "step", *TINY, "--n_steps=5"]) == 0
    rss_after_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    report = _report(capsys.readouterr().out)
    r = _floats(report, (
        "compile_s", "step_median_ms", "step_p90_ms", "loop_step_ms", "device_only_step_ms",
        "host_overhead_share", "steps_per_s", "peak_rss_mb", "full_step_ms", "repeat_step_ms",
        "ci_fn_ms", "ci_fn_share", "state_mb_per_device", "state_mb_total", "xla_gflop",
        "matmul_gflop", "achieved_gflop_per_s", "matmul_2048_gflop_per_s"))
    for key in ("compile_s", "step_median_ms", "loop_step_ms", "device_only_step_ms",
                "steps_per_s", "peak_rss_mb", "full_step_ms", "repeat_step_ms", "xla_gflop",
                "matmul_gflop", "achieved_gflop_per_s", "matmul_2048_gflop_per_s"):
        assert r[key] > 0, key
    # the step's matmul FLOPs run at the median step time
    assert r["achieved_gflop_per_s"] * r["step_median_ms"] == pytest.approx(
        1e3 * r["matmul_gflop"], rel=2 * PRINTED)
    assert r["step_p90_ms"] >= r["step_median_ms"]  # two percentiles of the same steps
    # steps/s is the back-to-back loop's rate: 1 / loop_step
    assert r["steps_per_s"] * r["loop_step_ms"] == pytest.approx(1e3, rel=PRINTED)
    # host overhead = 1 - device_only / loop, floored at 0
    assert 0 <= r["host_overhead_share"] <= 1
    assert r["host_overhead_share"] == pytest.approx(
        max(0.0, 1 - r["device_only_step_ms"] / r["loop_step_ms"]), abs=PRINTED)
    # the CI fn's part: full - repeat step (either sign: two timings), its share floored at 0
    assert r["ci_fn_ms"] == pytest.approx(r["full_step_ms"] - r["repeat_step_ms"],
                                          abs=PRINTED * (r["full_step_ms"] + r["repeat_step_ms"]))
    assert 0 <= r["ci_fn_share"] <= 1
    assert r["ci_fn_share"] == pytest.approx(
        max(0.0, 1 - r["repeat_step_ms"] / r["full_step_ms"]), abs=PRINTED)
    # the process's peak RSS only grows: read after the run, it bounds the printed one
    # (sampled before the A/Bs, so a loose bound: it catches e.g. KiB printed as MiB)
    assert r["peak_rss_mb"] <= rss_after_mb * (1 + PRINTED)
    # the train state: on one device its bytes are the summed sizes of its leaves' shapes
    cfg = cmdline.parse_config_args(TINY)[0]
    trainer = Trainer(cfg)
    shapes = jax.eval_shape(trainer.dec.init, trainer.target)
    state_mb = sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
                   for x in jax.tree.leaves(shapes)) / 2**20
    assert int(report["devices"]) == 1 and int(report["batch_size"]) == 64
    assert r["state_mb_per_device"] == pytest.approx(state_mb, rel=PRINTED)
    assert r["state_mb_total"] == pytest.approx(state_mb, rel=PRINTED)
    # at 64 rows the live-rows bound is over half the batch: no branch, no A/B keys
    assert _live_rows_bound(64, cfg.target.tms) > 64 // 2
    assert not any(k.startswith("live_rows") for k in report)


def test_bench_step_compares_the_live_rows_step_with_the_all_rows_step(capsys):
    """At 256 rows the TMS default's recon runs on the live-rows bound's gathered rows (104,
    live_rows.sizes): bench step reports it against the same step on every row (at 64 rows
    there is nothing to gather: no keys)."""
    args = ["--data.batch_size=256", "--decomp.steps=40", "--eval.batch_size=64"]
    assert cli.run(["bench", "step", *args, "--n_steps=20"]) == 0
    report = _report(capsys.readouterr().out)
    cfg = cmdline.parse_config_args(args)[0]
    assert cfg.target.kind == "tms"
    k = _live_rows_bound(256, cfg.target.tms)
    assert k <= 256 // 2
    assert int(report["live_rows_of_batch"]) == k
    r = _floats(report, ("live_rows_step_ms", "all_rows_step_ms", "live_rows_ratio"))
    assert r["live_rows_step_ms"] > 0 and r["all_rows_step_ms"] > 0
    # n_steps=20 is ONE paired round of 20 steps: the median of the per-round ratios is the
    # ratio of the two (single-round) medians
    assert r["live_rows_ratio"] == pytest.approx(
        r["live_rows_step_ms"] / r["all_rows_step_ms"], rel=PRINTED)


def test_bench_step_compares_the_step_with_and_without_its_persistent_pgd_terms(capsys,
                                                                              tmp_path):
    """The persistent-PGD cost (issue: <= 1.15x) as a paired A/B in one process, with the
    matmul FLOPs of each step; a config without such terms reports no such keys."""
    cfg = tmp_path / "ppgd.yaml"
    cfg.write_text("loss:\n  persistent_pgd:\n    adv: {scope: bsc, n_warmup: 2}\n")
    assert cli.run(["bench", "step", f"--config={cfg}", *TINY, "--n_steps=20"]) == 0
    report = _report(capsys.readouterr().out)
    r = _floats(report, ("with_ppgd_step_ms", "without_ppgd_step_ms", "persistent_pgd_ratio"))
    assert r["with_ppgd_step_ms"] > 0 and r["without_ppgd_step_ms"] > 0
    # one paired round (n_steps=20): the ratio is that of the two step times
    assert r["persistent_pgd_ratio"] == pytest.approx(
        r["with_ppgd_step_ms"] / r["without_ppgd_step_ms"], rel=PRINTED)
    # the term adds its n_warmup + 1 masked forwards and backwards
    assert float(report["with_ppgd_matmul_gflop"]) > float(report["without_ppgd_matmul_gflop"]) > 0
    assert cli.run(["bench", "step", *TINY, "--n_steps=5"]) == 0
    assert "persistent_pgd_ratio" not in capsys.readouterr().out


def test_bench_ckpt_reports_blocking_commit_and_bytes(capsys, tmp_path):
    assert cli.run(["bench", "ckpt", *TINY, "--n_saves=2", f"--run_dir={tmp_path}",
                    "--data.train_batch_replay=4", "--data.replay_ci_update=mean",
                    "--decomp.ci_fn.detach_inputs=true"]) == 0
    report = _report(capsys.readouterr().out)
    r = _floats(report, ("loop_block_ms_median", "background_commit_ms_median"))
    assert r["loop_block_ms_median"] > 0 and r["background_commit_ms_median"] > 0
    assert report["run_dir"] == str(tmp_path)
    # both saves are kept (keep_last_n=2) and committed: measure them on disk
    steps = sorted((d for d in tmp_path.joinpath("ckpts").iterdir() if d.name.isdigit()),
                   key=lambda d: int(d.name))
    assert len(steps) == 2 and all((d / "COMMITTED").exists() for d in steps)
    assert [d.name for d in steps] == ["3", "7"]  # steps 0-2 and 3-6: each save mid-window
    on_disk = [sum(os.path.getsize(os.path.join(root, f))
                   for root, _, files in os.walk(d) for f in files) for d in steps]
    assert int(report["bytes_per_checkpoint"]) == int(np.median(on_disk))
    # the logical bytes of each step's leaves, from its manifest's shapes and dtypes
    logical, window = [], []
    for d in steps:
        leaves = json.loads((d / "manifest.json").read_text())["leaves"]
        nbytes = {n: math.prod(i["shape"]) * jnp.dtype(i["dtype"]).itemsize
                  for n, i in leaves.items()}
        logical.append(sum(nbytes.values()))
        window.append(sum(b for n, b in nbytes.items() if n.startswith("training/replay/")))
    # a mid-window `mean` checkpoint carries its accumulator: the replay leaves' bytes
    assert int(report["window_state_bytes"]) == int(np.median(window)) > 0
    # chunks are stored raw (a bytes codec and a checksum, no compression)
    assert all(d >= b for d, b in zip(on_disk, logical))


def test_bench_step_reports_the_lm_steps_flop_count_and_rate(corpus, capsys):
    """The LM's step (token batches from the host) gets the same FLOP count and rate as the
    toys, beside the matmul's rate."""
    assert cli.run(["bench", "step", f"--config={corpus['config']}",
                    f"--target.path={corpus['target']}", f"--data.store={corpus['store']}",
                    "--n_steps=3"]) == 0
    r = _floats(_report(capsys.readouterr().out), (
        "xla_gflop", "matmul_gflop", "achieved_gflop_per_s", "matmul_2048_gflop_per_s",
        "step_median_ms"))
    assert all(v > 0 for v in r.values()), r
    assert r["achieved_gflop_per_s"] * r["step_median_ms"] == pytest.approx(
        1e3 * r["matmul_gflop"], rel=2 * PRINTED)


def test_the_step_rate_counts_each_scanned_block():
    """XLA's cost analysis counts a while body once: a CI transformer's scan over n blocks
    reads as one block. `_matmul_gflop` counts the body per iteration: 8 scanned
    [256, 128] x [128, 128] matmuls, forward and backward (3 per block), on the CPU."""
    from ppgd_tpu import bench

    def f(w, x):
        return jax.lax.scan(lambda h, wi: (jnp.tanh(h @ wi), None), x, w)[0].sum()

    compiled = jax.jit(jax.grad(f)).lower(jax.ShapeDtypeStruct((8, 128, 128), jnp.float32),
                                          jax.ShapeDtypeStruct((256, 128), jnp.float32)
                                          ).compile()
    per_block = 2 * 256 * 128 * 128 / 1e9
    assert bench._matmul_gflop(compiled) == pytest.approx(3 * 8 * per_block, rel=1e-9)
    assert bench._xla_gflop(compiled) < 8 * per_block


def test_bench_step_devices_reports_the_lm_state_shrinking_with_fsdp(corpus, capsys):
    """[D1] `bench step --devices 1,4` on the tiny LM: with every weight FSDP-sharded over 4
    devices, the per-device train state is well under the 1-device one (batch-row and
    replicated leaves, e.g. `sc` sources and scalars, keep it above 1/4)."""
    assert cli.run(["bench", "step", f"--config={corpus['config']}",
                    f"--target.path={corpus['target']}", f"--data.store={corpus['store']}",
                    "--devices", "1,4", "--mesh.data=1", "--mesh.fsdp=-1",
                    "--mesh.fsdp_min_elements=0", "--timing=false"]) == 0
    out = capsys.readouterr().out
    print(out)
    mb, n = {}, None  # one block of `key  value` lines per device count
    for key, value in (ln.split() for ln in out.splitlines() if ln.strip()):
        if key == "devices":
            n = int(value)
        elif key == "state_mb_per_device":
            mb[n] = float(value)
    assert set(mb) == {1, 4} and mb[4] < 0.5 * mb[1]


def test_bench_step_devices_on_the_lm_demo_config_as_readme_runs_it(corpus, capsys,
                                                                     tmp_path):
    """README's memory A/B on configs/lm_demo_2L.yaml (an untrained target, a small store):
    its children printed the memory and then segfaulted (exit 245 here, 3 of 3), exiting
    while the faithfulness warmup still computed; now they wait for it."""
    from ppgd_tpu.targets import build

    store = str(tmp_path / "store")
    assert cli.run(["tokenize", "--input", str(corpus["root"] / "*.txt"), "--output", store,
                    "--seq_len", "129"]) == 0
    cfg = config_lib.load("configs/lm_demo_2L.yaml").target
    target = str(tmp_path / "demo.safetensors")
    build.save(build.KINDS[cfg.kind].init(cfg.llama_simple_mlp, jax.random.key(0)), cfg,
               target)
    assert cli.run(["bench", "step", "--config=configs/lm_demo_2L.yaml",
                    f"--target.path={target}", f"--data.store={store}",
                    "--data.eval_rows=32", "--eval.batch_size=32", "--devices", "1,4",
                    "--mesh.data=1", "--mesh.fsdp=-1", "--timing=false"]) == 0, \
        capsys.readouterr().err[-3000:]
    assert [ln.split()[1] for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("devices ")] == ["1", "4"]


def test_bench_without_a_case_is_a_usage_error(capsys):
    assert cli.run(["bench"]) == 2
    assert "which benchmark" in capsys.readouterr().err


def test_bench_run_times_a_whole_run_and_refuses_an_unknown_cache_mode(capsys, tmp_path):
    assert cli.run(["bench", "run", *TINY, "--log.every=20", "--eval.every=20",
                    "--run_dir", str(tmp_path / "r"), "--compile_cache", "off"]) == 0  # as train
    report = dict(ln.split(None, 1) for ln in capsys.readouterr().out.splitlines() if ln.strip())
    assert report["compile_cache"] == "off" and float(report["wall_s"]) > 0
    assert (tmp_path / "r" / "summary.json").exists() and "eval/recon/ci_masked" in report
    assert cli.run(["bench", "run", *TINY, "--compile_cache=tepid"]) == 2
    assert "--compile_cache='tepid': use one of cold, warm, off" in capsys.readouterr().err


def test_a_failed_bench_run_leaves_no_temp_dir(capsys, tmp_path, monkeypatch):
    """Its run's refusal is shown; the temp run dir it made (empty) is gone."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cli.run(["bench", "run", *TINY, f"--target.path={tmp_path / 'nope'}"]) == 2
    assert "target.path: no such file" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["run", "ckpt"])
def test_a_bench_refuses_a_run_dir_that_holds_anything(capsys, tmp_path, case):
    """`bench ckpt --run_dir` of a real run retired the run's own checkpoints (keep_last_n 2)
    and the run then resumed from the bench's; `bench run` on a complete run timed its
    'already complete'. Both now want a new or empty dir, before any compute."""
    run = tmp_path / "run"
    (run / "ckpts" / "20").mkdir(parents=True)
    (run / "ckpts" / "20" / "COMMITTED").write_text("")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    assert cli.run(["bench", case, *TINY, "--run_dir", str(run)]) == 2
    assert f"--run_dir: {run} is not empty" in capsys.readouterr().err
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before
    (tmp_path / "a_file").write_text("")
    assert cli.run(["bench", case, *TINY, f"--run_dir={tmp_path / 'a_file' / 'x'}"]) == 2
    assert "--run_dir: " in capsys.readouterr().err


def test_bench_step_profile_lists_the_steps_xla_ops_by_time(capsys):
    """`--profile=N`: the N ops of the compiled step that a jax.profiler trace spent the most
    time in, each named as in the step's HLO, most expensive first."""
    assert cli.run(["bench", "step", *TINY, "--n_steps=5", "--profile=6"]) == 0
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.split("ms/step  ")[-1].splitlines()[1:] if ln.strip()]
    assert len(rows) == 6
    ms = [float(r[0]) for r in rows]
    assert ms == sorted(ms, reverse=True) and ms[0] > 0
    assert all(float(r[1]) >= 1 for r in rows)  # calls per step
    assert {r[3] for r in rows} & {"fusion", "dot", "while", "conditional"}
    assert cli.run(["bench", "step", *TINY, "--profile=0"]) == 2
    assert "--profile" in capsys.readouterr().err


def test_bench_step_says_whether_its_compile_was_a_compile_or_a_cache_load(tmp_path):
    """compile_s from a warm persistent cache is a load, ~2x less: the report says which.
    The `ppgd-tpu` entry point (a real process) enables the cache: a fresh cache is cold,
    the same bench again finds it warm, loading every program the first one compiled."""
    env = {**os.environ, "PPGD_TPU_CACHE": str(tmp_path / "cache")}
    env.pop("PPGD_TPU_COMPILE_CACHE", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    said = []
    for _ in range(2):
        p = subprocess.run([sys.executable, "-m", "ppgd_tpu.cli", "bench", "step", *TINY,
                            "--n_steps=2"], capture_output=True, text=True, env=env,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        said.append(_report(p.stdout)["compile_cache"])
    cold, warm = (re.fullmatch(r"(cold|warm): (\d+) of (\d+) programs loaded", x) for x in said)
    assert cold and warm, said
    assert cold.group(1, 2) == ("cold", "0") and int(cold.group(3)) >= 1, said
    assert warm.group(1) == "warm" and warm.group(2) == warm.group(3) == cold.group(3), said


@pytest.mark.parametrize("n,rounds,size", [(5, 1, 5), (45, 2, 20)])
def test_paired_rounds_time_n_steps_in_rounds_of_at_most_20(n, rounds, size):
    """--n_steps is what the paired A/Bs run: rounds of 20 steps (of all n when fewer),
    each timed as a whole; one call more per variant warms it up."""
    from ppgd_tpu import bench

    calls = []

    def step(state, target, batch):
        jax.debug.callback(lambda: calls.append(1))
        return state + 1, None

    trainer = Trainer(cmdline.parse_config_args(TINY)[0])
    times, _ = bench._paired_rounds(trainer, {"a": (step, jnp.zeros(())),
                                              "b": (step, jnp.zeros(()))}, n)
    jax.effects_barrier()
    assert [len(times["a"]), len(times["b"])] == [rounds, rounds]
    assert len(calls) == 2 * (1 + rounds * size)


def test_bench_replay_reports_interleaved_window_ratios_and_firsts_ideal(capsys):
    """Each mode's per-step window time, its median per-round ratio to `every`, and
    `first`'s ideal window ratio from its own full and repeat steps; the rounds are all
    timed after the compiles (no program compiled while timing)."""
    k = 4
    assert cli.run(["bench", "replay", *TINY, f"--k={k}", "--rounds=3"]) == 0
    report = _report(capsys.readouterr().out)
    assert int(report["k"]) == k and int(report["rounds"]) == 3
    assert int(report["compiles_while_timed"]) == 0
    modes = ("every", "first", "last", "mean")
    r = _floats(report, (*(f"window_step_ms/{m}" for m in modes),
                         *(f"window_step_vs_every/{m}" for m in modes[1:]),
                         "step_ms/first_full", "step_ms/first_repeat",
                         "window_step_ideal/first", "full_step_ms", "repeat_step_ms"))
    assert all(v > 0 for v in r.values()), r
    # the ideal from the printed median repeat/full ratio (both printed to 4 digits),
    # (1 + (k-1) ratio) / k: over 1/k
    # for any repeat time > 0. Whether it is under 1 (the repeat step faster than the full
    # one) is a timing, left to the bench: on a loaded 2-core CI machine it can be either
    ratio = float(report["repeat_over_full/first"])
    assert r["window_step_ideal/first"] == pytest.approx((1 + (k - 1) * ratio) / k, rel=2e-3)
    assert 1 / k < r["window_step_ideal/first"]
    # --windows is gone: each round is one window of every mode
    assert cli.run(["bench", "replay", *TINY, "--rounds=0"]) == 2
    assert "--rounds" in capsys.readouterr().err


def test_rotating_rounds_interleave_the_runs_in_an_order_rotating_per_round():
    """One untimed round (window 0: the compiles), then round r runs every name once on
    window r + 1, starting at the r-th name; a program compiled inside the timed rounds is
    counted."""
    from ppgd_tpu import bench

    calls = []

    def run(name, compile_each=False):
        def f(w):
            calls.append((name, w))
            if compile_each:  # a new function each call: a new program each call
                jax.block_until_ready(jax.jit(lambda x: x + w)(1.0))
        return f

    times, compiles = bench._rotating_rounds({"a": run("a"), "b": run("b")}, 3)
    assert calls == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("b", 2), ("a", 2),
                     ("a", 3), ("b", 3)]
    assert [len(times["a"]), len(times["b"])] == [3, 3] and compiles == 0
    assert all(t > 0 for t in times["a"] + times["b"])
    calls.clear()
    times, compiles = bench._rotating_rounds({"a": run("a"), "b": run("b"),
                                              "c": run("c", compile_each=True)}, 3)
    assert [n for n, w in calls if w > 0] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [w for _, w in calls] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert compiles == 3
