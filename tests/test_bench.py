"""The bench commands run and report their numbers (their values are not asserted: timings
live in benchmarks, not tests)."""

from ppgd_tpu import cli

TINY = ["--data.batch_size=64", "--decomp.steps=40", "--eval.batch_size=64"]


def test_bench_step_reports_step_time_and_host_overhead(capsys):
    assert cli.run(["bench", "step", *TINY, "--n_steps=5"]) == 0
    out = capsys.readouterr().out
    for key in ("compile_s", "step_median_ms", "device_only_step_ms", "host_overhead_share",
                "steps_per_s", "peak_rss_mb", "ci_fn_ms", "ci_fn_share"):
        assert key in out


def test_bench_step_compares_the_live_rows_step_with_the_all_rows_step(capsys):
    """At 256 rows the TMS default's recon runs on 104 gathered rows: bench step reports it
    against the same step on every row (at 64 rows there is nothing to gather: no keys)."""
    assert cli.run(["bench", "step", "--data.batch_size=256", "--decomp.steps=40",
                    "--eval.batch_size=64", "--n_steps=20"]) == 0
    report = dict(ln.split(None, 1) for ln in capsys.readouterr().out.splitlines() if ln.strip())
    assert int(report["live_rows_of_batch"]) == 104
    for key in ("live_rows_step_ms", "all_rows_step_ms", "live_rows_ratio"):
        assert float(report[key]) > 0


def test_bench_step_compares_the_step_with_and_without_its_persistent_pgd_terms(capsys,
                                                                              tmp_path):
    """The persistent-PGD cost (issue: <= 1.15x) as a paired A/B in one process, with XLA's
    FLOP count of each step; a config without such terms reports no such keys."""
    cfg = tmp_path / "ppgd.yaml"
    cfg.write_text("loss:\n  persistent_pgd:\n    adv: {scope: bsc, n_warmup: 2}\n")
    assert cli.run(["bench", "step", f"--config={cfg}", *TINY, "--n_steps=20"]) == 0
    report = dict(ln.split(None, 1) for ln in capsys.readouterr().out.splitlines() if ln.strip())
    for key in ("with_ppgd_step_ms", "without_ppgd_step_ms", "persistent_pgd_ratio"):
        assert float(report[key]) > 0
    # XLA's count of the work: the term adds its n_warmup + 1 masked forwards and backwards
    assert float(report["with_ppgd_xla_gflop"]) > float(report["without_ppgd_xla_gflop"]) > 0
    assert cli.run(["bench", "step", *TINY, "--n_steps=5"]) == 0
    assert "persistent_pgd_ratio" not in capsys.readouterr().out


def test_bench_ckpt_reports_blocking_commit_and_bytes(capsys, tmp_path):
    assert cli.run(["bench", "ckpt", *TINY, "--n_saves=2", f"--run_dir={tmp_path}",
                    "--data.train_batch_replay=4", "--data.replay_ci_update=mean",
                    "--decomp.ci_fn.detach_inputs=true"]) == 0
    out = capsys.readouterr().out
    assert "loop_block_ms_median" in out and "bytes_per_checkpoint" in out
    window = int(out.split("window_state_bytes")[1].split()[0])
    assert window > 0  # a mid-window `mean` checkpoint carries its accumulator


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


def test_bench_without_a_case_is_a_usage_error(capsys):
    assert cli.run(["bench"]) == 2
    assert "which benchmark" in capsys.readouterr().err


def test_bench_run_times_a_whole_run_and_refuses_an_unknown_cache_mode(capsys, tmp_path):
    assert cli.run(["bench", "run", *TINY, "--log.every=20", "--eval.every=20",
                    f"--run_dir={tmp_path / 'r'}", "--compile_cache=off"]) == 0
    report = dict(ln.split(None, 1) for ln in capsys.readouterr().out.splitlines() if ln.strip())
    assert report["compile_cache"] == "off" and float(report["wall_s"]) > 0
    assert (tmp_path / "r" / "summary.json").exists() and "eval/recon/ci_masked" in report
    assert cli.run(["bench", "run", *TINY, "--compile_cache=tepid"]) == 2
    assert "--compile_cache='tepid': use one of cold, warm, off" in capsys.readouterr().err


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
