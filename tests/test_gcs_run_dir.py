"""A whole run with RUN_DIR on gs:// (the real fake-gcs-server): round trip, a checkpoint
that never committed is ignored, and a SIGTERM'd run resumes exactly [C3, C4, C5]."""

import asyncio
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from conftest import tensorboard_series
from gcs_emulator import GcsEmulator
from ppgd_tpu import checkpoint, cli, load_decomposition, storage

ARGS = ["--decomp.steps=8", "--data.batch_size=32", "--eval.batch_size=64", "--eval.every=0",
        "--eval.pgd_steps=1", "--log.every=2", "--log.progress=false",
        "--decomp.ci_fn.detach_inputs=true", "--data.train_batch_replay=4",
        "--data.replay_ci_update=first"]


def test_round_trip_and_incomplete_checkpoint_on_gcs(gcs_emulator, tmp_path):
    run = gcs_emulator.run_dir()
    profile = ["--log.profile_start=2", "--log.profile_steps=2"]
    assert cli.run(["train", f"--run_dir={run}", "--checkpoint.every=2",
                    "--checkpoint.keep_last_n=10", *profile, *ARGS]) == 0
    summary = json.loads(storage.read_bytes(f"{run}/summary.json"))
    assert summary["step"] == 8 and "eval/recon/zero" in summary
    rows = [json.loads(r) for r in storage.read_bytes(f"{run}/metrics.jsonl").splitlines()]
    # the log steps, then the final eval's line, whose values summary.json repeats (it was
    # held in memory and never written on gs://)
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 8]
    assert rows[-1] == summary
    # TensorBoard's events too (they were written for local run dirs only, silently)
    logged = {(k, r["step"]): v for r in rows[:-1] for k, v in r.items() if k != "step"}
    shown = _tensorboard_on_gcs(run, tmp_path / "tb")
    assert shown == pytest.approx(logged, rel=1e-6)
    assert storage.exists(f"{run}/figures/ci_per_feature.png")
    comps = load_decomposition(run)
    assert comps["linear1"]["V"].shape == (5, 20)
    want = checkpoint.digest(run, 8).overall
    traced = f"{run}/profile/plugins/profile/step_2"
    host = f"{socket.gethostname()}-p0"
    assert storage.list_entries(traced) == [f"{host}.trace.json.gz", f"{host}.xplane.pb"]
    trace = storage.read_bytes(f"{traced}/{host}.trace.json.gz")

    # Interrupt: drop the end of the run, and leave a newer checkpoint that never committed
    # (a process killed mid-save): it is ignored, the last committed one (6) restores.
    storage.remove(f"{run}/summary.json")
    storage.remove(f"{run}/decomposition.safetensors")
    storage.remove_tree(f"{run}/ckpts/8")
    storage.write_bytes(f"{run}/ckpts/8/manifest.json", b"{partial")
    assert checkpoint.latest_step(run) == 6
    assert cli.run(["train", f"--run_dir={run}", "--checkpoint.every=2", *profile,
                    *ARGS]) == 0
    assert checkpoint.digest(run, 8).overall == want
    # resumed after the window: no second trace
    assert storage.list_entries(traced) == [f"{host}.trace.json.gz", f"{host}.xplane.pb"]
    assert storage.read_bytes(f"{traced}/{host}.trace.json.gz") == trace
    # `ppgd-tpu eval` of the final checkpoint, into the gs:// run dir: the same summary
    assert cli.run(["eval", f"--run_dir={run}", "--eval.figures=false"]) == 0
    assert json.loads(storage.read_bytes(f"{run}/evals/step_8/summary.json")) == summary
    again = [json.loads(r) for r in storage.read_bytes(f"{run}/metrics.jsonl").splitlines()]
    assert [r["step"] for r in again] == [2, 4, 6, 8, 8] and again[-1] == rows[-1]
    # the resumed writer's events (a second file) hide the redone step 8's, as locally [C3]
    resumed = _tensorboard_on_gcs(run, tmp_path / "tb_again")
    assert {k: v for k, v in resumed.items() if not k[0].startswith("train/perf/")} == {
        k: v for k, v in shown.items() if not k[0].startswith("train/perf/")}


def _tensorboard_on_gcs(run: str, local) -> dict:
    """RUN/tb's event files, copied to `local`, as TensorBoard shows them."""
    local.mkdir()
    names = storage.list_entries(f"{run}/tb")
    assert names, "no TensorBoard events"
    for name in names:
        (local / name).write_bytes(storage.read_bytes(f"{run}/tb/{name}"))
    return tensorboard_series(local)


def test_sigterm_resume_on_gcs(gcs_emulator):
    """[C5] on gs://: SIGTERM mid-loop commits a checkpoint of the step it stopped at. With
    periodic checkpoints off (--checkpoint.every=0) that save-on-stop is the only checkpoint
    the interrupted run can have, so a run that skipped it has none to show or resume from.
    The signal goes once the loop's metrics writer has put metrics.jsonl on gs:// (after the
    faithfulness warmup, so the stop lands in the step loop); the only timing assumed is that
    one 0.1 s poll is shorter than compiling and running 2000 steps, and a signal that came
    too late would fail the test (no "stopped at step" line), never pass it."""
    run = gcs_emulator.run_dir()
    args = [*[a.replace("--decomp.steps=8", "--decomp.steps=2000") for a in ARGS],
            "--log.every=50", "--checkpoint.every=0"]
    cmd = [sys.executable, "-m", "ppgd_tpu.cli", "train", f"--run_dir={run}", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        while not storage.exists(f"{run}/metrics.jsonl"):  # written as the step loop starts
            assert time.time() < deadline and p.poll() is None, "training did not start"
            time.sleep(0.1)
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, out
    m = re.search(r"stopped at step (\d+) \(SIGTERM", out)
    assert m and "Resume with the same command" in out, out
    stopped = int(m.group(1))
    assert 0 < stopped < 2000, out
    # the stopped step itself is committed, and it is the only checkpoint there is
    assert checkpoint.latest_step(run) == stopped, out
    assert storage.list_dirs(f"{run}/ckpts") == [str(stopped)], out
    assert not storage.exists(f"{run}/summary.json")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"resumed from the checkpoint at step {stopped}" in p.stdout + p.stderr
    assert json.loads(storage.read_bytes(f"{run}/summary.json"))["step"] == 2000
    # the interrupted trajectory is bitwise the straight one
    straight = gcs_emulator.run_dir()
    assert cli.run(["train", f"--run_dir={straight}", *args]) == 0
    assert checkpoint.digest(run, 2000).overall == checkpoint.digest(straight, 2000).overall


def _train_until_a_checkpoint(run: str, args: list[str]) -> subprocess.Popen:
    """A real `train` on gs:// `run`, returned once its first checkpoint has committed."""
    cmd = [sys.executable, "-m", "ppgd_tpu.cli", "train", f"--run_dir={run}", *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while checkpoint.latest_step(run) is None:
        if time.time() > deadline or p.poll() is not None:
            p.kill()
            raise AssertionError(f"no checkpoint committed: {p.communicate()[0][-3000:]}")
        time.sleep(0.05)
    return p


def test_sigkill_on_gcs_keeps_every_metrics_line_up_to_the_committed_step(gcs_emulator):
    """metrics.jsonl on gs:// is rewritten whole, so lines are buffered; a SIGKILL must not
    lose those of steps a committed checkpoint covers (the resume keeps the lines up to it and
    only redoes later ones): the file is stored before each checkpoint is saved."""
    run = gcs_emulator.run_dir()
    args = [*[a.replace("--decomp.steps=8", "--decomp.steps=2000") for a in ARGS],
            "--log.every=50", "--checkpoint.every=500", "--log.tensorboard=false"]
    p = _train_until_a_checkpoint(run, args)
    try:
        p.kill()
        p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    committed = checkpoint.latest_step(run)
    assert committed is not None and not storage.exists(f"{run}/summary.json")
    steps = [json.loads(ln)["step"] for ln in
             storage.read_bytes(f"{run}/metrics.jsonl").decode().splitlines()]
    assert steps[:committed // 50] == list(range(50, committed + 1, 50)), (committed, steps)
    assert cli.run(["train", f"--run_dir={run}", *args]) == 0
    rows = [json.loads(ln) for ln in storage.read_bytes(f"{run}/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in rows if "train/loss/total" in r] == list(range(50, 2001, 50))


def test_a_target_file_on_gcs_is_written_read_and_may_move_there_on_resume(gcs_emulator,
                                                                           tmp_path):
    """`pretrain --output` and `target.path` take gs:// (every host of a pod reads the one
    object); a run started from a local copy resumes from the gs:// one: same weights [C1]."""
    remote, local = f"{gcs_emulator.run_dir()}/t.safetensors", tmp_path / "t.safetensors"
    assert cli.run(["pretrain", f"--output={remote}"]) == 0
    local.write_bytes(storage.read_bytes(remote))
    run = tmp_path / "r"
    assert cli.run(["train", f"--target.path={local}", f"--run_dir={run}", *ARGS]) == 0
    (run / "summary.json").unlink()
    assert cli.run(["train", f"--target.path={remote}", f"--run_dir={run}", *ARGS]) == 0
    assert json.loads((run / "summary.json").read_text())["step"] == 8


@pytest.mark.parametrize("argv", [
    ["train", "--run_dir={where}/run"],
    ["pretrain", "--output={where}/t.safetensors"],
    ["tokenize", "--output={where}/store", "--input={text}", "--seq_len=4"],
], ids=["train", "pretrain", "tokenize"])
def test_a_bucket_that_does_not_exist_is_refused_before_compute(gcs_emulator, tmp_path,
                                                                capsys, argv):
    """The client's own error names an HTTP endpoint, after the target was trained; the
    refusal names the flag and the bucket, before any of it."""
    text = tmp_path / "in.txt"
    text.write_text("a document\n")
    where = f"gs://{gcs_emulator.bucket}-missing/x"
    argv = [a.format(where=where, text=text) for a in argv]
    capsys.readouterr()
    assert cli.run(argv) == 2
    err = capsys.readouterr().err
    flag = argv[1].split("=")[0]
    assert f"{flag}: bucket gs://{gcs_emulator.bucket}-missing does not exist" in err, err


@pytest.mark.parametrize("argv,refusal", [
    (["train", "--run_dir={obj}"], "--run_dir: {obj} exists and is not a directory (an object)"),
    (["tokenize", "--output={obj}", "--input={text}", "--seq_len=4"],
     "--output: {obj} exists and is not a directory (an object)"),
    (["pretrain", "--output={prefix}"],
     "--output: {prefix} exists and is not a file (a prefix holding objects)"),
    (["train", "--target.path={prefix}", "--run_dir={tmp}/r"],
     "target.path: {prefix} is a directory; expected a safetensors file"),
], ids=["train run_dir", "tokenize output", "pretrain output", "target.path"])
def test_an_object_where_a_prefix_belongs_or_the_reverse_is_refused(gcs_emulator, tmp_path,
                                                                     capsys, argv, refusal):
    """As locally: a run dir (or store) that is an object was accepted and written under
    it as a prefix; a weights file that is a prefix was an HTTP-endpoint traceback."""
    text = tmp_path / "in.txt"
    text.write_text("a document\n")
    prefix = gcs_emulator.run_dir()
    obj = f"{prefix}/summary.json"
    storage.write_bytes(obj, b"{}")
    names = {"obj": obj, "prefix": prefix, "text": text, "tmp": tmp_path}
    capsys.readouterr()
    assert cli.run([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err
    assert refusal.format(**names) in err and "Traceback" not in err, err
    assert storage.list_entries(prefix) == ["summary.json"]  # nothing written under it


class _Forbidding(http.server.BaseHTTPRequestHandler):
    """Cloud Storage to a caller without permission: 403 to everything, in its JSON form."""

    def _deny(self):
        body = json.dumps({"error": {"code": 403, "message":
                                     "caller does not have storage.objects.get access"}})
        self.send_response(403)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    do_GET = do_POST = do_PUT = do_DELETE = _deny

    def log_message(self, *args):
        pass


def test_storage_that_denies_access_ends_the_run_with_one_line_naming_the_path(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Forbidding)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    env = dict(os.environ, STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url)
    try:
        p = subprocess.run([sys.executable, "-m", "ppgd_tpu", "train",
                            "--run_dir=gs://private/run", *ARGS], env=env,
                           capture_output=True, text=True, timeout=300)
    finally:
        server.shutdown()
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("ppgd-tpu: failed: gs://private/run"), last
    assert "permission denied" in last and "storage.objects.get" in last, last


def test_cloud_storage_lost_mid_run_ends_it_in_minutes_with_one_line():
    """The service gone after a checkpoint committed: the run ends with status 1 and one
    line naming the path and Cloud Storage. It used to stay silent ~15 minutes (tensorstore's
    32 retries, then a wait for the save in flight, deaf to SIGTERM), then name the failed
    save instead of the cause. A service of its own: the session's must live on."""
    private = GcsEmulator().start(export_env=False)
    run = private.run_dir()
    prefix = run.split("/", 3)[3] + "/ckpts/"
    cmd = [sys.executable, "-m", "ppgd_tpu.cli", "train", f"--run_dir={run}",
           *[a.replace("--decomp.steps=8", "--decomp.steps=1000000") for a in ARGS],
           "--checkpoint.every=200", "--log.every=50", "--log.progress=true"]  # (a bar's
    # line, not a terminal's: the error's line must still start a line of its own)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, **private.env})
    try:
        deadline = time.time() + 300
        while not any(n.endswith("/COMMITTED") for n in private.names(prefix)):
            assert time.time() < deadline and p.poll() is None, "no checkpoint committed"
            time.sleep(0.1)
        private.kill()
        out, _ = p.communicate(timeout=400)  # the retries: ~2 minutes at most
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
        private.stop()
    assert p.returncode == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith(f"ppgd-tpu: failed: {run}/") and "Cloud Storage" in last, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def test_a_connection_failure_is_named_as_cloud_storage_out_of_reach():
    """The classification of the error the client raises for a host that does not answer,
    without a run's retries (the run: test_cloud_storage_lost_mid_run_...)."""
    import aiohttp

    async def get(port):
        async with aiohttp.ClientSession() as session:
            await session.get(f"http://127.0.0.1:{port}/")

    with socket.socket() as s, pytest.raises(aiohttp.ClientError) as e:
        s.bind(("127.0.0.1", 0))  # held, not listening: refused, and nobody else's meanwhile
        asyncio.run(get(s.getsockname()[1]))
    assert storage._gcs_failure(e.value).startswith("cannot reach Cloud Storage")
    # a service that stopped answering (frozen): gcsfs's timeout has no message of its own
    from fsspec.exceptions import FSTimeoutError

    assert storage._gcs_failure(FSTimeoutError()) == (
        f"cannot reach Cloud Storage (FSTimeoutError: no answer within {storage.GCS_STALL_S} s, "
        "retried); check the network")
    assert storage._gcs_failure(FileNotFoundError("gs://b/x")) is None  # absent: not this
