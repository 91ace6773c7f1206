"""`log.profile_start`: a jax.profiler trace of exactly the configured steps of a run, stored
in RUN_DIR/profile in the layout TensorBoard's profile plugin reads."""

import gzip
import json
import shutil
import socket

import pytest

from ppgd_tpu import cli

TINY = ["--decomp.steps=12", "--data.batch_size=64", "--eval.batch_size=256", "--eval.every=0",
        "--log.every=5", "--log.progress=false", "--eval.pgd_steps=2", "--eval.figures=false"]


def _steps_traced(trace_gz) -> int:
    """Dispatches of the training step in a trace: its host-side `PjitFunction(full)` spans,
    not counting those nested in another (JAX records each call at two levels)."""
    events = json.loads(gzip.decompress(trace_gz.read_bytes()))["traceEvents"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("ph") == "X" and e.get("name") == "PjitFunction(full)")
    outer = [a for a in spans if not any(b != a and b[0] <= a[0] and a[1] <= b[1]
                                         for b in spans)]
    return len(outer)


@pytest.mark.parametrize("start,n,traced", [(4, 3, (5, 7)), (10, 5, (11, 12))])
def test_the_profile_holds_the_steps_after_profile_start(tmp_path, capsys, start, n, traced):
    """Steps start+1 .. start+n; a window that runs past the last step keeps the steps up
    to it."""
    run_dir = tmp_path / "r"
    assert cli.run(["train", f"--run_dir={run_dir}", *TINY, f"--log.profile_start={start}",
                    f"--log.profile_steps={n}"]) == 0
    out = run_dir / "profile" / "plugins" / "profile" / f"step_{start}"
    name = f"{socket.gethostname()}-p0"
    assert sorted(p.name for p in out.iterdir()) == [f"{name}.trace.json.gz",
                                                     f"{name}.xplane.pb"]
    assert (out / f"{name}.xplane.pb").stat().st_size > 0
    assert _steps_traced(out / f"{name}.trace.json.gz") == traced[1] - traced[0] + 1
    assert f"profile of steps {traced[0]}..{traced[1]}: {out}/" in capsys.readouterr().out


def test_a_trace_that_cannot_be_stored_fails_with_that_error(tmp_path, capsys):
    """The store's own error is the failure: it was masked by a second stop of the profiler
    ("No profile started")."""
    run_dir = tmp_path / "r"
    argv = ["train", f"--run_dir={run_dir}", *TINY, "--checkpoint.every=4"]
    assert cli.run(argv) == 0
    for name in ("summary.json", "decomposition.safetensors"):
        (run_dir / name).unlink()
    shutil.rmtree(run_dir / "ckpts" / "12")  # resumes from step 8
    (run_dir / "profile").mkdir()
    (run_dir / "profile" / "plugins").write_text("a file where the trace's dirs go")
    with pytest.raises(NotADirectoryError, match="plugins"):
        cli.run([*argv, "--log.profile_start=9", "--log.profile_steps=2"])
