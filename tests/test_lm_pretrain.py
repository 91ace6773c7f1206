"""LM pretraining on a real byte-tokenized token store; the saved file loads via build.load."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from ppgd_tpu.cmdline import UsageError
from ppgd_tpu.commands import cmd_pretrain_lm
from ppgd_tpu.config import ConfigError, from_dict, load
from ppgd_tpu.data import tokenize
from ppgd_tpu.data.schedule import train_eval_schedules
from ppgd_tpu.data.tokens import TokenStore
from ppgd_tpu.targets import build, lm_pretrain

TINY = ["--target.kind=llama_simple_mlp", "--target.llama_simple_mlp.d_model=32",
        "--target.llama_simple_mlp.n_heads=2", "--target.llama_simple_mlp.n_kv_heads=1",
        "--target.llama_simple_mlp.d_mlp=64", "--target.llama_simple_mlp.max_seq_len=32",
        "--target.llama_simple_mlp.pretrain.steps=50",
        "--target.llama_simple_mlp.pretrain.batch_size=16",
        "--target.llama_simple_mlp.pretrain.lr=0.01",
        "--target.llama_simple_mlp.pretrain.warmup_steps=5",
        "--target.llama_simple_mlp.pretrain.eval_rows=32",
        "--target.llama_simple_mlp.pretrain.eval_batches=2",
        "--target.llama_simple_mlp.pretrain.eval_every=25",
        "--target.llama_simple_mlp.pretrain.log_every=10", "--log.progress=false"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it"]
    rng = np.random.default_rng(0)
    for i in range(4):
        text = " ".join(rng.choice(words, 1500)) + "."
        (root / f"doc{i}.txt").write_text(text)
    out = str(root / "store")
    assert tokenize.main(["--input", str(root / "*.txt"), "--output", out,
                          "--seq_len", "17"]) == 0
    return out


def test_pretrain_loss_falls_and_the_file_loads_back(store, tmp_path):
    out = str(tmp_path / "lm.safetensors")
    assert cmd_pretrain_lm([*TINY, "--store", store, "--output", out]) == 0
    lines = [json.loads(x) for x in open(lm_pretrain.metrics_path(out))]
    evals = [x["eval/loss"] for x in lines if "eval/loss" in x]
    train = [x["train/loss"] for x in lines if "train/loss" in x]
    assert [x["step"] for x in lines if "eval/loss" in x] == [0, 25, 50]
    assert evals[0] > np.log(384) - 0.5  # ~uniform over the byte vocabulary at init
    assert evals[-1] < evals[0] - 1.5 and train[-1] < train[0] - 0.3

    cfg = load(None, dict(a[2:].split("=", 1) for a in TINY)).target
    target = build.load(cfg, out)
    build.check(target, cfg)
    # The reloaded model reproduces the logged final eval loss on the held-out rows.
    st = TokenStore.open(store)
    _, held = train_eval_schedules(st.n_rows, train_batch=16, train_seed=cfg.seed,
                                   eval_batch=16, eval_seed=cfg.seed + 1, eval_rows=32)
    losses = [float(lm_pretrain.next_token_loss(target, jnp.asarray(st.read_rows(held.rows(j)),
                                                                    jnp.int32)))
              for j in range(2)]
    assert np.mean(losses) == pytest.approx(evals[-1], rel=1e-4)


def test_a_finished_pretraining_is_not_redone_and_another_replaces_it_said(store, tmp_path,
                                                                          capsys):
    """The same command again found nothing to resume and trained every step again; one of
    another config replaced the file without a word."""
    out = str(tmp_path / "lm.safetensors")
    assert cmd_pretrain_lm([*TINY, "--store", store, "--output", out]) == 0
    written = {p: open(p, "rb").read() for p in (out, lm_pretrain.metrics_path(out))}
    capsys.readouterr()
    cadences = ["--target.llama_simple_mlp.pretrain.log_every=5",  # not the weights
                "--target.llama_simple_mlp.remat=true"]
    assert cmd_pretrain_lm([*TINY, *cadences, "--store", store, "--output", out]) == 0
    said = capsys.readouterr().out
    assert f"{out}: already complete: it holds the target of this config, pretrained on this " \
           "token store; nothing to do" in said
    assert {p: open(p, "rb").read() for p in written} == written
    longer = "--target.llama_simple_mlp.pretrain.steps=60"
    assert cmd_pretrain_lm([*TINY, longer, "--store", store, "--output", out]) == 0
    assert (f"{out} holds a target pretrained otherwise (target.llama_simple_mlp.pretrain."
            "steps: 50 there, 60 here); this pretraining replaces it") in capsys.readouterr().out
    assert open(out, "rb").read() != written[out]
    assert json.loads(open(lm_pretrain.metrics_path(out)).readlines()[-1])["step"] == 60


def test_pretrain_refuses_what_the_lm_cannot_read(store, tmp_path):
    """... and a refusal leaves nothing: no lock file, no dir made for the output."""
    out = str(tmp_path / "new" / "dirs" / "lm.safetensors")
    with pytest.raises(ConfigError, match="vocab_size: 100 is smaller"):
        cmd_pretrain_lm([*TINY, "--target.llama_simple_mlp.vocab_size=100", "--store", store,
                          "--output", out])
    with pytest.raises(ConfigError, match="max_seq_len: 8 is shorter"):
        cmd_pretrain_lm([*TINY, "--target.llama_simple_mlp.max_seq_len=8", "--store", store,
                          "--output", out])
    with pytest.raises(ConfigError, match="--store: no token store"):
        cmd_pretrain_lm([*TINY, "--store", str(tmp_path / "nope"), "--output", out])
    assert sorted(os.listdir(tmp_path)) == []
    os.makedirs(lm_pretrain.metrics_path(out))  # its log goes beside it: checked up front
    with pytest.raises(UsageError, match="--output: .*lm.safetensors needs .*lm.metrics.jsonl "
                                         "beside it, but .* exists and is not a file"):
        cmd_pretrain_lm([*TINY, "--store", store, "--output", out])
    os.rmdir(lm_pretrain.metrics_path(out))
    with pytest.raises(ConfigError, match="target.kind"):
        lm_pretrain.pretrain_lm(from_dict(type(load(None).target), {"kind": "tms"}), store, out)
    assert not os.path.exists(out)


def test_the_shipped_pretrain_config_parses():
    path = os.path.join(os.path.dirname(__file__), "..", "configs",
                        "llama_simple_mlp_2L_pretrain.yaml")
    cfg = load(path)
    assert cfg.target.kind == "llama_simple_mlp"
    names = list(build.site_shapes(cfg.target))
    assert len(names) == 12 and names[-1] == "h.1.mlp.down_proj"


@pytest.mark.parametrize("checkpoint_every,needle", [
    (0, "step 10: train/loss = nan"),  # the first log step after it
    (3, "step 6: the weights have non-finite values"),  # a save: the update came after the loss
])
def test_a_diverged_pretraining_stops_with_status_1_and_saves_no_nan(store, tmp_path, capsys,
                                                                     checkpoint_every, needle):
    """A far too large lr: the first log step with a non-finite loss, or the first save of
    non-finite weights, ends the run (exit 1, the step named, the way out said); no weights
    are written and no resume state with nan in it (the same command would resume it)."""
    from safetensors import numpy as safetensors_numpy

    from ppgd_tpu import cli

    out = str(tmp_path / "lm.safetensors")
    rc = cli.run(["pretrain", *TINY, "--store", store, "--output", out,
                  "--target.llama_simple_mlp.pretrain.lr=1e4",
                  "--target.llama_simple_mlp.pretrain.grad_clip=0",
                  f"--target.llama_simple_mlp.pretrain.checkpoint_every={checkpoint_every}"])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert f"ppgd-tpu pretrain: error: {needle}" in err, err
    assert f"delete {lm_pretrain.resume_path(out)} if it exists" in err
    assert not os.path.exists(out)
    state = lm_pretrain.resume_path(out)
    assert os.path.exists(state) == bool(checkpoint_every)  # step 3's, from before it
    if checkpoint_every:
        tensors = safetensors_numpy.load(open(state, "rb").read())
        assert all(np.isfinite(t).all() for t in tensors.values())


def test_a_resume_state_edited_by_hand_is_refused_naming_it(store, tmp_path, capsys):
    """A resume state with the right record but a tensor gone or mis-shaped (a KeyError or
    a dot_general TypeError mid-run before) is refused before training, exit 2, naming the
    file and the tensor; the state stays. Made here by a pretraining that diverged after
    its step-3 save."""
    from safetensors import numpy as safetensors_numpy

    from ppgd_tpu import cli

    out = str(tmp_path / "lm.safetensors")
    args = ["pretrain", *TINY, "--store", store, "--output", out,
            "--target.llama_simple_mlp.pretrain.lr=1e4",
            "--target.llama_simple_mlp.pretrain.grad_clip=0",
            "--target.llama_simple_mlp.pretrain.checkpoint_every=3"]
    assert cli.run(args) == 1
    path = lm_pretrain.resume_path(out)
    blob = open(path, "rb").read()
    metadata = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])["__metadata__"]
    tensors = safetensors_numpy.load(blob)
    for edit, needle in [(lambda t: t.pop("opt/3"), "'opt/3': None there"),
                         (lambda t: t.update({"target/wte": t["target/wte"][:, :4]}),
                          "'target/wte': (384, 4) there, (384, 32) here")]:
        edited = dict(tensors)
        edit(edited)
        open(path, "wb").write(safetensors_numpy.save(edited, metadata=metadata))
        capsys.readouterr()
        assert cli.run(args) == 2
        err = capsys.readouterr().err
        assert f"--output: {path} (the resume state of an interrupted pretrain) is damaged" in err
        assert needle in err and "delete it to start over" in err, err
        assert os.path.exists(path)
    # given to train as the target (its name is close to the weights' own): said what it is
    lm_yaml = os.path.join(os.path.dirname(__file__), "..", "configs", "lm_demo_2L.yaml")
    rc = cli.run(["train", f"--config={lm_yaml}", *TINY, f"--target.path={path}",
                  f"--data.store={store}",
                  f"--run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and "is the saved state of an interrupted pretraining, not a target" in err
    assert len(err) < 400 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("stop_in", ["epoch", "check_finite"])
def test_a_stop_while_a_step_is_logged_resumes_to_the_straight_runs_log(store, tmp_path,
                                                                        monkeypatch, stop_in):
    """A SIGTERM's raise lands anywhere in the loop (the handler raises): while step 20's
    log line is being made (its `train.epoch`), or just after it is written (its finiteness
    check). Either way the state saved and its log agree (the raise before the line used
    to save step 20's state without its line), so the resumed run's log and weights are a
    straight run's."""
    from safetensors import numpy as safetensors_numpy

    from ppgd_tpu import metrics, signals
    from ppgd_tpu.data.schedule import BatchSchedule

    straight = str(tmp_path / "straight.safetensors")
    assert cmd_pretrain_lm([*TINY, "--store", store, "--output", straight]) == 0
    out = str(tmp_path / "lm.safetensors")
    owner = BatchSchedule if stop_in == "epoch" else metrics
    real = getattr(owner, stop_in)

    def stop_at_step_20(*args):
        value = real(*args)
        if args[-1] == 19 if stop_in == "epoch" else args[0] == 20:
            raise signals.Terminated
        return value

    monkeypatch.setattr(owner, stop_in, stop_at_step_20)
    with pytest.raises(signals.Terminated):
        cmd_pretrain_lm([*TINY, "--store", store, "--output", out])
    monkeypatch.undo()
    assert os.path.exists(lm_pretrain.resume_path(out))
    assert cmd_pretrain_lm([*TINY, "--store", store, "--output", out]) == 0
    assert open(lm_pretrain.metrics_path(out)).read() == \
        open(lm_pretrain.metrics_path(straight)).read()
    got, want = safetensors_numpy.load_file(out), safetensors_numpy.load_file(straight)
    assert all(np.array_equal(got[k], want[k]) for k in want)


def test_a_second_pretrain_on_an_output_being_written_is_refused(store, tmp_path, capsys):
    """Two pretrainings of one --output would interleave its log and resume state: while
    one runs (a real process), another exits 2 naming the output and the holder's pid, and
    the holder is not disturbed; once the holder has stopped, the lock is free at once."""
    import signal
    import subprocess
    import sys
    import time

    from ppgd_tpu import cli, lockfile

    out = str(tmp_path / "lm.safetensors")
    args = ["pretrain", *TINY, "--target.llama_simple_mlp.pretrain.steps=1000000",
            "--store", store, "--output", out]
    holder = subprocess.Popen([sys.executable, "-m", "ppgd_tpu.cli", *args],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lock = lm_pretrain.lock_path(out)
    try:
        deadline = time.time() + 300
        while not (os.path.exists(lock) and f"pid {holder.pid} " in open(lock).read()):
            assert holder.poll() is None, holder.communicate()[0][-3000:]
            assert time.time() < deadline, "the first pretrain never took its lock"
            time.sleep(0.1)
        # (6 steps: were it not refused, it would end soon, not train for ever)
        assert cli.run([*args, "--target.llama_simple_mlp.pretrain.steps=6"]) == 2
        err = capsys.readouterr().err
        assert (f"ppgd-tpu pretrain: error: --output: {out} is being written by another "
                f"`ppgd-tpu pretrain` (pid {holder.pid} on host") in err, err
        assert holder.poll() is None
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.communicate(timeout=300)
    os.close(lockfile.acquire(lock))  # not stale: taken at once
