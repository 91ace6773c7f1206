"""Exact resume through the real loop [C3, W6]: N straight steps == K steps, stop, restore,
N-K steps, bitwise, for every K and every replay mode; and a real SIGTERM [C5]."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import pytest

from conftest import tensorboard_series
from ppgd_tpu import checkpoint, cli

N, K_REPLAY = 8, 4
TINY = ["--data.batch_size=32", "--eval.batch_size=64", "--eval.every=0", "--eval.pgd_steps=1",
        "--eval.figures=false", "--log.every=1", "--log.progress=false",
        "--log.tensorboard=false", "--decomp.ci_fn.detach_inputs=true",
        "--loss.imp_min.coeff=0.01", "--decomp.faithfulness_warmup_steps=3"]


def _args(run_dir, mode, extra=(), k=None):
    k = k or (1 if mode == "every" else K_REPLAY)
    return ["train", f"--run_dir={run_dir}", f"--decomp.steps={N}",
            f"--data.train_batch_replay={k}", f"--data.replay_ci_update={mode}", *TINY, *extra]


def _stopped_at(straight, K, copy):
    """A copy of the finished run `straight` as a stop after its step-K checkpoint leaves
    it: no summary, no checkpoint after K (but every file it wrote past K)."""
    shutil.copytree(straight, copy)
    os.remove(copy / "summary.json")
    for d in os.listdir(copy / "ckpts"):
        if int(d) > K:
            shutil.rmtree(copy / "ckpts" / d)
    return copy


def _final_digest(run_dir):
    return checkpoint.digest(str(run_dir), N).overall


def _no_perf_lines(path) -> list[dict]:
    return [{k: v for k, v in json.loads(ln).items() if not k.startswith("train/perf/")}
            for ln in open(path)]


@pytest.mark.parametrize("mode,k", [("every", 1), ("every", K_REPLAY), ("first", K_REPLAY),
                                    ("last", K_REPLAY), ("mean", K_REPLAY)])
def test_C3_W6_resume_at_every_step_is_bitwise_the_straight_run(tmp_path, mode, k):
    straight = tmp_path / "straight"
    # a checkpoint after every step, all kept: each is a possible preemption point
    assert cli.run(_args(straight, mode, ["--checkpoint.every=1",
                                          f"--checkpoint.keep_last_n={N + 1}"], k)) == 0
    want = _final_digest(straight)
    metrics = _no_perf_lines(straight / "metrics.jsonl")
    # every window position t = 1, 2, 3, 0, and N: the finish killed before summary.json
    for K in [*range(1, K_REPLAY + 1), N]:
        resumed = _stopped_at(straight, K, tmp_path / f"resumed_{K}")
        with open(resumed / "metrics.jsonl", "a") as fh:
            fh.write('{"step": 3, "train/loss/to')  # a write torn by the kill
        assert cli.run(_args(resumed, mode, ["--checkpoint.every=1"], k)) == 0
        assert _final_digest(resumed) == want, f"mode {mode}: resume at K={K} diverged"
        # the lines after K dropped and logged again: the straight run's, value for value
        assert _no_perf_lines(resumed / "metrics.jsonl") == metrics, f"mode {mode}, K={K}"
        shutil.rmtree(resumed)


def _no_perf(series: dict) -> dict:
    return {key: v for key, v in series.items() if not key[0].startswith("train/perf/")}


def test_C3_a_resumed_run_logs_what_the_straight_run_logged(tmp_path):
    """After a resume between log steps (the checkpoint at K; the killed command had logged
    past it), metrics.jsonl and TensorBoard show the straight run's values: lines and events
    after K are replaced, not duplicated, and the first log line's window statistics (the
    grad norms' min/median/max since the last log) cover the steps before the stop too,
    carried by the checkpoint. Temp files of writes the kill cut short are removed."""
    log_every = 4
    extra = [f"--log.every={log_every}", "--log.tensorboard=true", "--checkpoint.every=1",
             f"--checkpoint.keep_last_n={N + 1}"]
    straight = tmp_path / "straight"
    assert cli.run(_args(straight, "first", extra)) == 0
    want = [json.loads(ln) for ln in open(straight / "metrics.jsonl")]
    assert any(k.endswith("/max") for k in want[0])
    shown = tensorboard_series(straight / "tb")
    logged = {(k, r["step"]): v for r in want[:-1] for k, v in r.items()
              if k != "step" and not k.startswith("train/perf/")}  # the last: final eval
    assert {key: shown[key] for key in logged} == pytest.approx(logged, rel=1e-6)
    for K in (2, log_every, 6):
        resumed = _stopped_at(straight, K, tmp_path / f"resumed_{K}")
        torn = [resumed / "metrics.jsonl.tmp-0123abcd", resumed / "figures.tmp-89ab"]
        for path in torn:
            path.write_bytes(b"cut short")
        assert cli.run(_args(resumed, "first", extra)) == 0
        assert not any(path.exists() for path in torn)
        again = [json.loads(ln) for ln in open(resumed / "metrics.jsonl")]
        assert [r["step"] for r in again] == [r["step"] for r in want]
        for old, new in zip(want, again):
            old = {k: v for k, v in old.items() if not k.startswith("train/perf/")}
            assert {k: new[k] for k in old} == old, f"K={K}, step {old['step']}"
        assert _no_perf(tensorboard_series(resumed / "tb")) == _no_perf(shown), f"K={K}"
        shutil.rmtree(resumed)


def test_resume_refuses_a_different_trajectory_and_changes_nothing(tmp_path, capsys):
    run = tmp_path / "r"
    base = _args(run, "every", ["--checkpoint.every=4"])
    assert cli.run(base) == 0
    os.remove(run / "summary.json")
    shutil.rmtree(run / "ckpts" / str(N))
    before = sorted(os.listdir(run / "ckpts"))
    rc = cli.run([*base, "--decomp.grad_clip_components=0.5"])
    assert rc == 2 and "decomp.grad_clip_components: 0.01 -> 0.5" in capsys.readouterr().err
    assert sorted(os.listdir(run / "ckpts")) == before


def test_C4_a_damaged_committed_checkpoint_is_refused_and_the_one_before_resumes(tmp_path,
                                                                                  capsys):
    """A committed step with a chunk gone (it would read as zeros) or cut short is refused
    with status 2 naming it, before anything is written; with that step deleted, as the message
    says, the run resumes from the one before and ends where the straight run does."""
    run = tmp_path / "r"
    base = _args(run, "every", ["--checkpoint.every=4"])
    assert cli.run(base) == 0
    want = _final_digest(run)
    os.remove(run / "summary.json")
    os.remove(run / "decomposition.safetensors")
    leaf = run / "ckpts" / str(N) / "decomposition" / "components" / "U" / "linear2"
    for damage in ("missing", "truncated"):
        chunk = leaf / "c" / "0" / "0"
        if damage == "missing":
            saved = chunk.read_bytes()
            chunk.unlink()
        else:
            chunk.write_bytes(saved[:-5])
        metrics = (run / "metrics.jsonl").read_bytes()
        capsys.readouterr()
        assert cli.run(base) == 2, damage
        err = capsys.readouterr().err
        assert f"committed checkpoint {run / 'ckpts' / str(N)} is damaged" in err, err
        assert "ckpt verify" in err
        assert (run / "metrics.jsonl").read_bytes() == metrics
        assert not (run / "summary.json").exists()
    shutil.rmtree(run / "ckpts" / str(N))
    assert cli.run(base) == 0
    assert _final_digest(run) == want


def _edit_manifest(sdir, edit):
    d = json.loads((sdir / "manifest.json").read_text())
    edit(d)
    (sdir / "manifest.json").write_text(json.dumps(d))


MANIFEST_DAMAGE = {  # what a hand edit, a copy or a lost file leaves; the error it gave
    "missing": lambda sdir: (sdir / "manifest.json").unlink(),  # FileNotFoundError
    "a directory": lambda sdir: ((sdir / "manifest.json").unlink(),
                                 (sdir / "manifest.json").mkdir()),  # IsADirectoryError
    "a leaf less": lambda sdir: _edit_manifest(  # resume's ValueError traceback
        sdir, lambda d: d["leaves"].pop("decomposition/components/U/linear2")),
    "a leaf more": lambda sdir: _edit_manifest(  # 'add a placement rule to mesh.py'
        sdir, lambda d: d["leaves"].update(
            {"decomposition/ci_fn/w9": d["leaves"]["decomposition/components/U/linear2"]})),
    "log_window not a list": lambda sdir: _edit_manifest(  # TypeError traceback
        sdir, lambda d: d["meta"].update(log_window=5)),
    "another step's": lambda sdir: _edit_manifest(  # resumed silently at the wrong step
        sdir, lambda d: d.update(step=N - 4)),
}


def test_C4_a_committed_checkpoint_whose_manifest_is_damaged_is_refused_naming_it(tmp_path,
                                                                                   capsys):
    """Each manifest damage is refused with status 2 naming the step and the way out, before
    anything is written (they were tracebacks, a message asking to edit mesh.py, or a silent
    resume); a manifest from a newer format asks for an upgrade instead of a deletion."""
    run = tmp_path / "r"
    base = _args(run, "every", ["--checkpoint.every=4"])
    assert cli.run(base) == 0
    os.remove(run / "summary.json")
    sdir = run / "ckpts" / str(N)
    shutil.copytree(sdir, tmp_path / "pristine")
    metrics = (run / "metrics.jsonl").read_bytes()
    for name, damage in [*MANIFEST_DAMAGE.items(), ("newer", lambda sdir: _edit_manifest(
            sdir, lambda d: d.update(format_version=d["format_version"] + 1)))]:
        damage(sdir)
        capsys.readouterr()
        assert cli.run(base) == 2, name
        err = capsys.readouterr().err
        if name == "newer":
            assert "written by a newer ppgd-tpu" in err and "upgrade" in err, err
            assert "delete" not in err
        else:
            assert f"committed checkpoint {sdir} is damaged" in err, (name, err)
            assert "Traceback" not in err and err.count("delete") == 1, (name, err)
        assert (run / "metrics.jsonl").read_bytes() == metrics
        assert not (run / "summary.json").exists()
        shutil.rmtree(sdir)
        shutil.copytree(tmp_path / "pristine", sdir)
    assert cli.run(base) == 0  # the step, restored, resumes


def _train_subprocess(run_dir, steps, extra=()):
    cmd = [sys.executable, "-m", "ppgd_tpu.cli", "train", f"--run_dir={run_dir}",
           f"--decomp.steps={steps}", "--data.train_batch_replay=4",
           "--data.replay_ci_update=first", *TINY, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_C5_sigterm_saves_the_completed_step_exits_0_and_resumes_exactly(tmp_path):
    """The signal lands after ~5 logged steps; logging every step syncs the loop with the
    host, so it stops within a step or two of that, far before the end."""
    steps = 400
    straight = tmp_path / "straight"
    p = _train_subprocess(straight, steps)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    want = checkpoint.digest(str(straight), steps).overall

    run = tmp_path / "interrupted"
    p = _train_subprocess(run, steps)
    deadline = time.time() + 300
    while not (run / "metrics.jsonl").exists() or os.path.getsize(run / "metrics.jsonl") < 2000:
        assert time.time() < deadline and p.poll() is None, "training did not start"
        time.sleep(0.2)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=300)
    assert p.returncode == 0, out
    assert "stopped at step" in out and f"Resume with the same command and --run_dir={run}." in out
    stopped = checkpoint.latest_step(str(run))
    assert 0 < stopped < steps
    assert not (run / "summary.json").exists()
    p = _train_subprocess(run, steps)
    out, _ = p.communicate(timeout=600)
    assert p.returncode == 0, out
    assert checkpoint.digest(str(run), steps).overall == want


# A real `ppgd-tpu train` whose final phase (or last save) receives a real signal: `hook`
# replaces a function of that phase with one that signals this process first.
_SIGNAL_IN = """
import os, signal, sys
from ppgd_tpu import cli, engine
where, name = sys.argv[1], sys.argv[2]
owner = engine.eval_lib if where == "figures" else engine
real = getattr(owner, where)
def hook(*args):
    if where == "figures" or args[0] == {steps}:  # the final save's check
        os.kill(os.getpid(), getattr(signal, name))
    return real(*args)
setattr(owner, where, hook)
sys.argv = ["ppgd-tpu", *sys.argv[3:]]
cli.main()
"""


@pytest.mark.parametrize("where", ["figures", "check_decomposition_finite"])
@pytest.mark.parametrize("name,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_C5_a_signal_in_the_final_phase_ends_the_command_and_a_rerun_finishes(
        tmp_path, where, name, code):
    """Once the final checkpoint is committed, a signal during the final eval, decomposition
    and figures (an LM's take minutes) ends the command at once with 130 / 143; one that
    came during the final save is delivered then. Both were noted and ignored, silently. The
    same command then finishes the run from that checkpoint, as a straight run would."""
    straight = tmp_path / "straight"
    args = [a for a in _args(straight, "every") if a != "--eval.figures=false"]
    assert cli.run(args) == 0
    run = tmp_path / "signalled"
    argv = [a.replace(str(straight), str(run)) for a in args]
    p = subprocess.run([sys.executable, "-c", _SIGNAL_IN.format(steps=N), where, name,
                        *argv], capture_output=True, text=True, timeout=600)
    assert p.returncode == code, p.stderr[-3000:]
    assert f"({name}); nothing partial is read as complete" in p.stderr, p.stderr[-3000:]
    assert checkpoint.latest_step(str(run)) == N and not (run / "summary.json").exists()
    assert cli.run(argv) == 0
    assert (json.loads((run / "summary.json").read_text())
            == json.loads((straight / "summary.json").read_text()))
    assert _final_digest(run) == _final_digest(straight)


def test_C2_load_decomposition_reads_a_stopped_run_from_its_checkpoint(tmp_path):
    from ppgd_tpu import load_decomposition

    run = tmp_path / "r"
    assert cli.run(_args(run, "every", ["--checkpoint.every=4"])) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a finished run's components are final: no warning
        final = load_decomposition(str(run))
        os.remove(run / "decomposition.safetensors")  # lost: its last checkpoint is final
        from_final_ckpt = load_decomposition(str(run))
    os.remove(run / "summary.json")  # as if the run had stopped at step N
    with pytest.warns(UserWarning, match=f"{run} has not finished: these are the components "
                      f"of its checkpoint at step {N}, not the final ones") as caught:
        from_ckpt = load_decomposition(str(run))
    assert [w.filename for w in caught] == [__file__]  # the caller's line, not the package's
    assert set(from_ckpt) == set(from_final_ckpt) == set(final) == {"linear1", "linear2"}
    for site in final:
        for part in ("V", "U"):
            assert (from_ckpt[site][part] == final[site][part]).all()
            assert (from_final_ckpt[site][part] == final[site][part]).all()


def test_W1_the_loop_trains_step_s_on_batch_s_div_k(tmp_path):
    """[W1] through the real loop: a run with k = 2 ends where a hand loop over
    trainer.batch(s // 2) ends, bitwise, and not where one over trainer.batch(s) ends."""
    from ppgd_tpu import config, resume
    from ppgd_tpu.engine import Trainer

    run = tmp_path / "r"
    assert cli.run(["train", f"--run_dir={run}", "--decomp.steps=4",
                    "--data.train_batch_replay=2", "--data.replay_ci_update=every",
                    "--checkpoint.every=4", *TINY]) == 0
    got = checkpoint.restore(str(run), 4).arrays
    trainer = Trainer(config.load(str(run / "config.yaml")))

    def by_hand(batch_of_step):
        state = trainer.init_state()
        for s in range(4):
            state, _ = trainer.replay.full(state, trainer.target, trainer.batch(batch_of_step(s)))
        return {n: np.asarray(x) for n, x in resume.state_leaves(state).items()}

    want = by_hand(lambda s: s // 2)
    assert all((got[n] == want[n]).all() for n in want)
    other = by_hand(lambda s: s)
    assert not all((got[n] == other[n]).all() for n in other)
