"""Bad targets, outputs and token stores are refused up front, by name, with exit status 2;
nothing already written is lost and a partial file is never read as a finished one.

All on real files: NaN targets written by the package's own `build.save`, token stores
written by `ppgd-tpu tokenize` and then damaged on disk, a real pretrain process killed
mid-run.
"""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from safetensors import numpy as safetensors_numpy

from conftest import TINY_YAML, bpe_tokenizer
from helpers import run_command
from ppgd_tpu import cli
from ppgd_tpu.config import load
from ppgd_tpu.data import tokens
from ppgd_tpu.data.tokenize import HFTokenizer
from ppgd_tpu.data.tokens import IncompleteStoreError, TokenStore
from ppgd_tpu.targets import build, lm_pretrain


# ---------------------------------------------------------------- 1. non-finite toy targets


@pytest.mark.parametrize("config,tensor,value", [
    (None, "W", np.nan),  # the embedded TMS 5-2 default
    (None, "b", np.nan),
    ("configs/resid_mlp1.yaml", "layers.0.mlp_out", np.inf),
    ("configs/resid_mlp1.yaml", "W_E", np.nan),
])
def test_a_non_finite_toy_target_is_refused_by_tensor_before_any_step(
        config, tensor, value, tmp_path, capsys):
    """A target file that is valid safetensors of the right shapes, one weight non-finite:
    `train --target.path` exits 2 naming the tensor, and no run dir is created."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    config = config and os.path.join(root, config)
    cfg = load(config).target
    mod, sub = build.KINDS[cfg.kind], getattr(cfg, cfg.kind)
    if cfg.kind == "tms":  # a trained TMS (1 s) passes validation until one weight is NaN
        target = build.pretrain(cfg)
        build.check(target, cfg)
    else:  # an untrained ResidMLP fails on its read-off MSE, but must be refused by tensor
        target = mod.init(sub, jax.random.key(0))
    sd = {k: np.array(v) for k, v in mod.state_dict(target).items()}
    sd[tensor].flat[0] = value
    path = str(tmp_path / "bad.safetensors")
    build.save(mod.from_state_dict(sub, sd), cfg, path)

    run = tmp_path / "run"
    rc, _, err = run_command(["train", *([f"--config={config}"] if config else []),
                       f"--target.path={path}", f"--run_dir={run}"], capsys)
    assert rc == 2, err
    assert f"tensor {tensor!r} has non-finite values" in err
    assert "failed validation" in err
    assert not run.exists()  # refused before the run dir, so before any decomposition step


# ---------------------------------------------------------------- 2. tokenize --output


def _corpus(tmp_path) -> str:
    d = tmp_path / "corpus"
    d.mkdir()
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it"]
    for i in range(4):
        (d / f"doc{i}.txt").write_text(" ".join(rng.choice(words, 1500)) + ".")
    return str(d / "*.txt")


@pytest.mark.parametrize("where", ["an existing file", "a path under a file"])
def test_tokenize_refuses_an_output_it_cannot_create_before_reading_input(
        where, tmp_path, capsys):
    """Both fail for root too (a read-only chmod would not): exit 2, a short message that
    names --output and the path, and the file in the way is left as it was."""
    blocker = tmp_path / "notes.txt"
    blocker.write_text("keep me")
    output = str(blocker if where == "an existing file" else blocker / "store")
    rc, _, err = run_command(["tokenize", "--input", _corpus(tmp_path), "--output", output,
                       "--seq_len", "17"], capsys)
    assert rc == 2
    assert err.startswith("ppgd-tpu tokenize: error: --output: ") and str(blocker) in err
    assert "tensorstore" not in err and len(err) < 400, err
    assert blocker.read_text() == "keep me"


def test_tokenize_checks_output_before_any_input_is_read(tmp_path, capsys):
    """A damaged parquet input would be read (scanned for its vocabulary) first; the output
    is refused before that: nothing of the input is read for a store that cannot exist."""
    (tmp_path / "docs.parquet").write_bytes(b"not parquet at all")
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, _, err = run_command(["tokenize", "--input", str(tmp_path / "*.parquet"), "--output",
                       str(blocker / "store"), "--seq_len", "17"], capsys)
    assert rc == 2 and "--output: " in err and "parquet" not in err, err


def test_tokenize_names_an_input_file_it_cannot_read(tmp_path, capsys):
    """A file the glob matched that cannot be read (here a link to /proc/self/mem, as a
    file gone or without permission would be) was an fsspec traceback, exit 1; the store
    it was writing stays incomplete, so nothing reads it as one."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("fine " * 200)
    (corpus / "z.txt").symlink_to("/proc/self/mem")
    out = tmp_path / "store"
    rc, _, err = run_command(["tokenize", "--input", str(corpus / "*.txt"), "--output", str(out),
                       "--seq_len", "17"], capsys)
    assert rc == 2 and f"--input: cannot read {corpus / 'z.txt'}" in err, err
    with pytest.raises(IncompleteStoreError):
        TokenStore.open(str(out))


@pytest.mark.parametrize("layout", ["a user's files", "a tokens/ dir of a user's",
                                    "a meta.json of a user's"])
def test_tokenize_refuses_an_output_holding_other_files_and_deletes_nothing(
        layout, tmp_path, capsys):
    """Writing a store replaces what is at --output (its tokens/ array is recreated), so an
    output that holds anything but a token store is refused, exit 2, naming what is there;
    over an existing store (a rewrite) it goes on."""
    out = tmp_path / "mine"
    files = {"a user's files": {"notes.txt": "keep"},
             "a tokens/ dir of a user's": {"tokens/notes.txt": "keep"},
             "a meta.json of a user's": {"meta.json": "{}", "tokens/zarr.json": "{}"}}[layout]
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    corpus = _corpus(tmp_path)
    rc, _, err = run_command(["tokenize", "--input", corpus, "--output", str(out),
                       "--seq_len", "17"], capsys)
    assert rc == 2, err
    assert err.startswith(f"ppgd-tpu tokenize: error: --output: {out} holds files that are "
                          "not a token store's (") and "give a new or empty directory" in err
    assert {str(p.relative_to(out)): p.read_text() for p in out.rglob("*") if p.is_file()} \
        == files
    store = tmp_path / "store"
    for _ in range(2):  # a new store, then a rewrite of it
        rc, _, err = run_command(["tokenize", "--input", corpus, "--output", str(store),
                           "--seq_len", "17"], capsys)
        assert rc == 0, err


# ---------------------------------------------------------------- 3. damaged token stores


@pytest.fixture(scope="module")
def lm_setup(tmp_path_factory):
    """A byte-level store (rows of 17 tokens), the tiny LM config and an (untrained, finite)
    LM target file for it: what `train --data.store` needs to reach the store."""
    root = tmp_path_factory.mktemp("robust")
    store = str(root / "store")
    assert cli.run(["tokenize", "--input", _corpus(root), "--output", store,
                    "--seq_len", "17"]) == 0
    config = root / "tiny.yaml"
    config.write_text(TINY_YAML)
    cfg = load(str(config)).target
    target = str(root / "lm.safetensors")
    build.save(build.KINDS[cfg.kind].init(cfg.llama_simple_mlp, jax.random.key(0)), cfg,
               target)
    return {"store": store, "config": str(config), "target": target}


def _copy_store(src, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def _damage(store: str, how: str) -> str:
    """Damages the store on disk; returns the damaged file's path inside the store."""
    if how == "garbage meta.json":
        name = tokens.META_FILE
        with open(os.path.join(store, name), "w") as f:
            f.write('{"format": "ppgd_tpu.token_store", "n_rows": 1')  # cut mid-write
    elif how == "meta.json not a mapping":
        name = tokens.META_FILE
        with open(os.path.join(store, name), "w") as f:
            f.write("[1, 2, 3]")
    elif how == "shard cut short":
        name = "tokens/c/0/0"
        p = os.path.join(store, name)
        os.truncate(p, os.path.getsize(p) // 2)
    elif how == "shard lost":
        name = "tokens/c/0/0"
        os.remove(os.path.join(store, name))
    else:
        raise AssertionError(how)
    assert os.path.exists(os.path.join(store, tokens.MARKER_FILE))  # still marked complete
    return name


DAMAGE = ["garbage meta.json", "meta.json not a mapping", "shard cut short", "shard lost"]


@pytest.mark.parametrize("how", DAMAGE)
def test_a_damaged_store_is_refused_at_open_naming_the_file(how, lm_setup, tmp_path):
    store = _copy_store(lm_setup["store"], tmp_path / "store")
    name = _damage(store, how)
    with pytest.raises(IncompleteStoreError) as e:
        TokenStore.open(store)
    assert os.path.join(store, name) in str(e.value) and "re-run `ppgd-tpu tokenize`" in str(
        e.value)


def test_a_shard_lost_after_open_fails_its_read_instead_of_reading_zeros(lm_setup, tmp_path):
    """A store rewritten (or damaged) under a running command: its open found it whole, a
    later read of a shard that is gone names the shard; tensorstore would fill zeros."""
    store = _copy_store(lm_setup["store"], tmp_path / "store")
    opened = TokenStore.open(store)
    assert opened.read_rows(np.arange(4)).any()
    os.remove(os.path.join(store, "tokens", "c", "0", "0"))
    with pytest.raises(IncompleteStoreError,
                       match=r"tokens/c/0/0: cannot read token rows .* re-run `ppgd-tpu "):
        opened.read_rows(np.arange(4))


def test_weights_made_with_another_architecture_are_refused_naming_the_fields(
        lm_setup, tmp_path, capsys):
    """The same tensor shapes read with other heads or another rope base are another
    function: the file's recorded config is checked field by field; a file of another kind
    is named as such (not as a list of missing tensors)."""
    run = tmp_path / "run"
    base = ["train", f"--config={lm_setup['config']}", f"--data.store={lm_setup['store']}",
            f"--run_dir={run}"]
    rc, _, err = run_command([*base, f"--target.path={lm_setup['target']}",
                       "--target.llama_simple_mlp.n_heads=4",
                       "--target.llama_simple_mlp.n_kv_heads=2",
                       "--target.llama_simple_mlp.rope_base=100"], capsys)
    assert rc == 2, err
    assert f"{lm_setup['target']} was made with another architecture" in err
    for field in ("n_heads: 4 here, 2 in the file", "n_kv_heads: 2 here, 1 in the file",
                  "rope_base: 100.0 here, 10000.0 in the file"):
        assert f"target.llama_simple_mlp.{field}" in err, err
    toy = tmp_path / "tms.safetensors"
    cfg = load(None).target
    build.save(build.build(cfg), cfg, str(toy))
    rc, _, err = run_command([*base, f"--target.path={toy}"], capsys)
    assert rc == 2 and f"{toy} holds a 'tms' target (per its metadata)" in err, err
    assert not run.exists()


def test_a_store_from_another_tokenizer_than_the_lms_pretraining_is_refused(
        corpus, lm_setup, tmp_path, capsys, caplog):
    """Token ids mean tokens of one tokenizer: a pretrained LM records its store's
    tokenizer, and a decomposition on a store of another one (a vocabulary small enough to
    pass the size check) exits 2 naming data.store, before the run dir exists. The same
    tokenizer.json at another path is the same tokenizer; weights from elsewhere (no
    record) are not checked; a pre-tokenized side (tokenizer unknown) cannot be, which is
    said (but of the LM's own store)."""
    docs = [open(f).read() for f in sorted(glob.glob(str(corpus["root"] / "*.txt")))]
    bpe = bpe_tokenizer(str(tmp_path / "tokenizer.json"), docs, vocab_size=300)
    store = str(tmp_path / "bpe_store")
    assert run_command(["tokenize", "--input", str(corpus["root"] / "*.txt"), "--output", store,
                 "--seq_len", "17", "--tokenizer", bpe], capsys)[0] == 0
    bpe_id = TokenStore.open(store).tokenizer_id
    assert bpe_id.startswith("vocab-sha256:") and TokenStore.open(store).vocab_size <= 384
    assert TokenStore.open(corpus["store"]).tokenizer_id == "byte"
    run = tmp_path / "run"
    rc, _, err = run_command(["train", f"--config={corpus['config']}", f"--run_dir={run}",
                       f"--target.path={corpus['target']}", f"--data.store={store}"], capsys)
    assert rc == 2, err
    assert (f"data.store: {store} was tokenized with another tokenizer ({bpe_id}) than the "
            f"target at target.path {corpus['target']} was pretrained on (byte: byte)") in err
    assert not run.exists()
    copy = shutil.copy(bpe, tmp_path / "elsewhere.json")
    assert HFTokenizer(str(copy)).id == bpe_id
    own = TokenStore.open(corpus["store"]).store_id
    on_pq = str(tmp_path / "on_pq.safetensors")  # pretrained on a pre-tokenized store
    cfg = load(corpus["config"]).target
    build.save(build.load(cfg, corpus["target"]), cfg, on_pq,
               data={"store": "pq", "store_id": "pq-id", "tokenizer": "pretokenized",
                     "tokenizer_id": None})
    with caplog.at_level("WARNING"):
        build.check_tokenizer(corpus["target"], "byte", "another", "byte_store")
        build.check_tokenizer(corpus["target"], None, own, "its_own_store")
        build.check_tokenizer(on_pq, None, "pq-id", "pq")
        build.check_tokenizer(lm_setup["target"], bpe_id, None, store)  # no data record
        assert not caplog.records
        build.check_tokenizer(corpus["target"], None, "another", "pq")
        build.check_tokenizer(on_pq, bpe_id, None, store)
    end = "no tokenizer, so nothing checks that the store's ids are the tokens the target " \
        "was trained on"
    assert [r.getMessage() for r in caplog.records] == [
        f"data.store pq (pre-tokenized input) records {end}",
        f"target.path {on_pq} (pretrained on pre-tokenized input) records {end}"]


def test_a_resume_refuses_a_store_whose_rows_changed_since_the_run_started(lm_setup, tmp_path,
                                                                           capsys):
    """[C3] batch j is rows of the store: a store tokenized again at the same path from
    another corpus is refused on resume, exit 2, naming data.store. The same rows resume:
    the same tokenize command run again (a pipeline re-run after a preemption) keeps the
    store's id, and so does a copy at another path."""
    corpus = _corpus(tmp_path)
    store = tmp_path / "store"
    tokenize = ["tokenize", "--input", corpus, "--output", str(store), "--seq_len", "17"]
    assert run_command(tokenize, capsys)[0] == 0
    run = tmp_path / "run"
    args = ["train", f"--config={lm_setup['config']}", f"--target.path={lm_setup['target']}",
            f"--run_dir={run}", "--decomp.steps=4", "--checkpoint.every=2", "--eval.every=0",
            "--log.every=2", "--eval.figures=false", "--decomp.faithfulness_warmup_steps=2"]

    def stopped_at_step_2():  # as a stop after the step-2 checkpoint leaves the run dir
        os.remove(run / "summary.json")
        shutil.rmtree(run / "ckpts" / "4")

    assert run_command([*args, f"--data.store={store}"], capsys)[0] == 0
    stopped_at_step_2()
    store_id = TokenStore.open(str(store)).store_id
    assert run_command(tokenize, capsys)[0] == 0
    assert TokenStore.open(str(store)).store_id == store_id
    rc, _, err = run_command([*args, f"--data.store={store}"], capsys)
    assert rc == 0 and (run / "summary.json").exists(), err

    stopped_at_step_2()
    shutil.copytree(store, tmp_path / "moved")
    (tmp_path / "corpus" / "doc4.txt").write_text("a dog sat on it.")
    assert run_command(tokenize, capsys)[0] == 0
    before = sorted(os.listdir(run))
    rc, _, err = run_command([*args, f"--data.store={store}"], capsys)
    assert rc == 2, err
    assert (f"data.store: the token store at {store} is not the one {run} was started with"
            in err and "its rows differ" in err), err
    assert sorted(os.listdir(run)) == before and not (run / "summary.json").exists()
    rc, _, err = run_command([*args, f"--data.store={tmp_path / 'moved'}"], capsys)
    assert rc == 0 and (run / "summary.json").exists(), err


@pytest.mark.parametrize("how", ["garbage meta.json", "shard cut short"])
def test_train_refuses_a_damaged_store_with_status_2(how, lm_setup, tmp_path, capsys):
    store = _copy_store(lm_setup["store"], tmp_path / "store")
    _assert_train_refuses(store, _damage(store, how), lm_setup, tmp_path / "run", capsys)


def _assert_train_refuses(store, name, lm_setup, run, capsys):
    """`train` on the damaged `store` exits 2 naming data.store and the file, briefly,
    before the run dir is made."""
    rc, _, err = run_command(["train", f"--config={lm_setup['config']}",
                       f"--target.path={lm_setup['target']}", f"--data.store={store}",
                       f"--run_dir={run}"], capsys)
    assert rc == 2, err
    assert err.startswith("ppgd-tpu train: error: data.store: ")
    assert os.path.join(store, name) in err and "tokenize" in err and len(err) < 1000
    assert not run.exists()


@pytest.mark.parametrize("how", ["garbage meta.json", "shard cut short"])
def test_pretrain_refuses_a_damaged_store_with_status_2(how, lm_setup, tmp_path, capsys):
    store = _copy_store(lm_setup["store"], tmp_path / "store")
    name = _damage(store, how)
    out = tmp_path / "lm.safetensors"
    rc, _, err = run_command(["pretrain", f"--config={lm_setup['config']}", f"--store={store}",
                       f"--output={out}"], capsys)
    assert rc == 2, err
    assert err.startswith("ppgd-tpu pretrain: error: --store: ")
    assert os.path.join(store, name) in err and "tokenize" in err
    assert not out.exists() and not os.path.exists(lm_pretrain.metrics_path(str(out)))


def test_a_store_from_before_the_recorded_sizes_is_still_checked(lm_setup, tmp_path, capsys):
    """A store whose meta.json has no `array_files` opens and reads as before; a lost shard
    is refused at open, a shard cut short at its first read, both naming the file."""
    def legacy(dst):
        store = _copy_store(lm_setup["store"], dst)
        meta_path = os.path.join(store, tokens.META_FILE)
        with open(meta_path) as f:
            meta = json.load(f)
        meta.pop("array_files", None)
        with open(meta_path, "w") as f:
            json.dump(meta, f)
        return store

    good = legacy(tmp_path / "good")
    np.testing.assert_array_equal(TokenStore.open(good).read_rows(np.arange(5)),
                                  TokenStore.open(lm_setup["store"]).read_rows(np.arange(5)))

    lost = legacy(tmp_path / "lost")
    _damage(lost, "shard lost")
    with pytest.raises(IncompleteStoreError, match="is missing"):
        TokenStore.open(lost)

    cut = legacy(tmp_path / "cut")
    name = _damage(cut, "shard cut short")
    TokenStore.open(cut)  # nothing recorded to compare its size with
    _assert_train_refuses(cut, name, lm_setup, tmp_path / "run", capsys)


# ---------------------------------------------------------------- 4. the pretrain log


def test_a_killed_pretrain_rerun_keeps_the_previous_weights_and_their_log(
        lm_setup, tmp_path, capsys):
    out = str(tmp_path / "lm.safetensors")
    log = lm_pretrain.metrics_path(out)
    base = [f"--config={lm_setup['config']}", f"--store={lm_setup['store']}", f"--output={out}"]
    assert run_command(["pretrain", *base], capsys)[0] == 0
    weights, metrics = open(out, "rb").read(), open(log).read()
    assert json.loads(metrics.splitlines()[-1])["step"] == 30
    assert not os.path.exists(log + ".partial")

    # The same output again, a run long enough to be killed while it trains (with no resume
    # state, which the next test covers: a state of steps=1000000 would refuse steps=20).
    proc = subprocess.Popen(
        [sys.executable, "-m", "ppgd_tpu.cli", "pretrain", *base,
         "--target.llama_simple_mlp.pretrain.steps=1000000",
         "--target.llama_simple_mlp.pretrain.log_every=1",
         "--target.llama_simple_mlp.pretrain.checkpoint_every=0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    partial = log + ".partial"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            started = (os.path.exists(partial) and os.path.getsize(partial) > 0) or (
                open(log).read() != metrics)  # (where a run that logs in place shows it)
            if started:
                time.sleep(0.5)  # a few steps logged
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert open(out, "rb").read() == weights
    assert open(log).read() == metrics  # the log of the weights that are there
    # The killed run's progress is there for a look, under a name nothing reads as a log.
    assert json.loads(open(partial).readline())["step"] == 0

    # A run that finishes replaces both, and leaves no partial log.
    assert run_command(["pretrain", *base, "--target.llama_simple_mlp.pretrain.steps=20"],
                capsys)[0] == 0
    steps = [json.loads(x)["step"] for x in open(log)]
    assert steps[-1] == 20 and open(out, "rb").read() != weights
    assert not os.path.exists(partial)


def test_a_pretrain_stopped_by_sigterm_resumes_to_the_weights_and_log_of_a_straight_run(
        lm_setup, tmp_path, capsys):
    """A real SIGTERM mid-run saves the resume state at the last completed step (exit 143);
    the same command continues from it, exactly: the weights and the log equal a straight
    run's. A resume with another trajectory field, or on a store of other rows, is refused
    naming it, keeping the state; the store tokenized again from the same corpus (another
    path here) resumes; the finished run deletes the state."""
    def args(out, *more, store=lm_setup["store"]):
        return [f"--config={lm_setup['config']}", f"--store={store}",
                f"--output={out}", "--target.llama_simple_mlp.pretrain.steps=300",
                "--target.llama_simple_mlp.pretrain.log_every=1",
                "--target.llama_simple_mlp.pretrain.eval_every=100", *more]

    straight = str(tmp_path / "straight.safetensors")
    assert run_command(["pretrain", *args(straight)], capsys)[0] == 0
    out = str(tmp_path / "lm.safetensors")
    state = lm_pretrain.resume_path(out)
    proc = subprocess.Popen([sys.executable, "-m", "ppgd_tpu", "pretrain", *args(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    partial = lm_pretrain.partial_metrics_path(out)
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if os.path.exists(partial) and open(partial).read().count("train/loss") >= 3:
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.01)
        err = proc.communicate(timeout=300)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    stopped = int(re.search(r"pretraining stopped at step (\d+); ", err).group(1))
    # the 3rd loss line is written before its step counts as done: the stop may keep step 2
    assert 2 <= stopped < 300 and os.path.exists(state) and not os.path.exists(out), err

    rc, _, err = run_command(["pretrain", *args(out, "--target.llama_simple_mlp.pretrain.lr=0.02")],
                      capsys)
    assert rc == 2 and "target.llama_simple_mlp.pretrain.lr: 0.01 there, 0.02 here" in err, err
    assert os.path.exists(state)
    corpus = _corpus(tmp_path)  # lm_setup's store's
    for name in ("again", "other"):
        assert run_command(["tokenize", "--input", corpus, "--output", str(tmp_path / name),
                     "--seq_len", "17"], capsys)[0] == 0
        (tmp_path / "corpus" / "doc4.txt").write_text("a dog sat on it.")  # other rows next
    rc, _, err = run_command(["pretrain", *args(out, store=tmp_path / "other")], capsys)
    assert rc == 2 and f"--store: {tmp_path / 'other'} is not the store" in err, err
    assert "(its rows differ)" in err and os.path.exists(state)

    rc, printed, err = run_command(["pretrain", *args(out, store=tmp_path / "again")], capsys)
    assert rc == 0, err
    assert f"resuming the pretraining at step {stopped} from {state}" in printed
    assert not os.path.exists(state)
    got, want = safetensors_numpy.load_file(out), safetensors_numpy.load_file(straight)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert open(lm_pretrain.metrics_path(out)).read() == open(
        lm_pretrain.metrics_path(straight)).read()


def test_on_gcs_the_sizes_are_recorded_and_checked_and_the_log_goes_with_the_weights(
        gcs_emulator, lm_setup, tmp_path, capsys, monkeypatch):
    """The same checks through gcsfs listings, and `pretrain --output gs://...` puts its log
    next to the weights (kept locally until then, never in a local `gs:` directory)."""
    root = gcs_emulator.run_dir()
    store = f"{root}/store"
    assert cli.run(["tokenize", "--input", _corpus(tmp_path), "--output", store,
                    "--seq_len", "17"]) == 0
    st = TokenStore.open(store)
    assert st.meta["array_files"] == TokenStore.open(lm_setup["store"]).meta["array_files"]
    np.testing.assert_array_equal(st.read_rows(np.arange(4)),
                                  TokenStore.open(lm_setup["store"]).read_rows(np.arange(4)))

    out = f"{root}/lm.safetensors"
    monkeypatch.chdir(tmp_path)
    assert run_command(["pretrain", f"--config={lm_setup['config']}", f"--store={store}",
                 f"--output={out}", "--target.llama_simple_mlp.pretrain.steps=10"],
                capsys)[0] == 0
    from ppgd_tpu import storage

    steps = [json.loads(x)["step"] for x in
             storage.read_bytes(lm_pretrain.metrics_path(out)).decode().splitlines()]
    assert steps[-1] == 10 and storage.exists(out) and not (tmp_path / "gs:").exists()

    fs, p = tokens.fs_for(f"{store}/tokens/c/0/0")
    fs.pipe_file(p, fs.cat_file(p)[:1000])  # the shard object replaced by a cut-short one
    rc, _, err = run_command(["pretrain", f"--config={lm_setup['config']}", f"--store={store}",
                       f"--output={tmp_path / 'x.safetensors'}"], capsys)
    assert rc == 2 and f"{store}/tokens/c/0/0 has 1000 bytes" in err, err
