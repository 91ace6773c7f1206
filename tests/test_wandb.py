"""`log.wandb`: real Weights & Biases runs in offline mode, read back from the run's offline
directory (the .wandb transaction log that `wandb sync` uploads); a resumed run continues
the same W&B run; only process 0 logs; a W&B failure (online without credentials) only
warns."""

import glob
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ppgd_tpu import cli

wandb = pytest.importorskip("wandb", reason="the wandb extra: pip install -e '.[wandb]'")
from wandb.proto import wandb_internal_pb2  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--decomp.steps=20", "--data.batch_size=64", "--eval.batch_size=256", "--eval.every=10",
        "--log.every=5", "--log.progress=false", "--log.tensorboard=false", "--eval.pgd_steps=1",
        "--checkpoint.every=10", "--checkpoint.keep_last_n=3", "--log.wandb.mode=offline",
        "--log.wandb.tags=test,tms"]


@pytest.fixture(autouse=True)
def no_wandb_account(tmp_path, monkeypatch):
    """No credentials and no reachable server, whatever this machine has."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))


def records(path: str) -> list:
    """The Records of a .wandb file: a 7-byte header (":W&B", magic, version), then blocks
    of 32 KiB holding chunks, each a 7-byte header (crc32, length u16, type: 1 full,
    2 first, 3 middle, 4 last) and its bytes (the LevelDB log format)."""
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    out, at, pending, block = [], 7, b"", 32768
    while at + 7 <= len(data):
        room = block - at % block
        if room < 7:  # the block's tail is padding
            at += room
            continue
        _, length, kind = struct.unpack("<IHB", data[at:at + 7])
        if kind == 0 and length == 0:
            break
        pending += data[at + 7:at + 7 + length]
        at += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def offline_runs(run_dir) -> list[str]:
    return sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*")))


def history(recs) -> dict[int, dict]:
    out = {}
    for r in recs:
        if r.WhichOneof("record_type") == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                     for i in r.history.item}
            step = items.get("_step", r.history.step.num)
            out.setdefault(step, {}).update(items)
    return out


def test_offline_run_holds_config_history_images_summary_and_a_resume_continues_it(tmp_path):
    run_dir = tmp_path / "run"
    assert cli.run(["train", f"--run_dir={run_dir}", *TINY]) == 0
    record = json.loads((run_dir / "wandb.json").read_text())
    (first,) = offline_runs(run_dir)
    assert first.endswith(record["id"])
    recs = records(f"{first}/run-{record['id']}.wandb")
    run = next(r.run for r in recs if r.WhichOneof("record_type") == "run")
    assert run.run_id == record["id"] and list(run.tags) == ["test", "tms"]
    updates = [*run.config.update, *(i for r in recs if r.WhichOneof("record_type") == "config"
                                     for i in r.config.update)]
    config = {i.key: json.loads(i.value_json) for i in updates}
    assert config["decomp"]["steps"] == 20 and config["log"]["wandb"]["mode"] == "offline"
    logged = history(recs)
    lines = [json.loads(ln) for ln in open(run_dir / "metrics.jsonl")]
    assert sorted(logged) == sorted({r["step"] for r in lines})  # every record's step
    for line in lines:
        for k, v in line.items():
            if k != "step" and isinstance(v, float):
                assert logged[line["step"]][k] == pytest.approx(v), (line["step"], k)
    images = {k.removesuffix("/_type"): v for k, v in logged[20].items()
              if k.startswith("figures/") and k.endswith("/_type")}
    assert set(images.values()) == {"image-file"} and len(images) == 5
    assert "figures/ci_per_feature" in images
    assert len(glob.glob(f"{first}/files/media/images/figures/*.png")) == 5
    summary = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for r in recs
               if r.WhichOneof("record_type") == "summary" for i in r.summary.update}
    final = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval/recon/zero"] == pytest.approx(final["eval/recon/zero"])

    # the run stopped after its step-10 checkpoint: resumed, it continues the same W&B run
    os.remove(run_dir / "summary.json")
    shutil.rmtree(run_dir / "ckpts" / "20")
    assert cli.run(["train", f"--run_dir={run_dir}", *TINY]) == 0
    second = [d for d in offline_runs(run_dir) if d != first]
    assert len(second) == 1 and second[0].endswith(record["id"])
    assert json.loads((run_dir / "wandb.json").read_text()) == record
    again = history(records(f"{second[0]}/run-{record['id']}.wandb"))
    assert sorted(again) == [15, 20]  # what the resumed run logged: after step 10


def test_a_wandb_failure_warns_and_training_goes_on(tmp_path, capfd):
    """Online without credentials: wandb.init raises; the run ends as ever."""
    run_dir = tmp_path / "run"
    assert cli.run(["train", f"--run_dir={run_dir}", *TINY, "--log.wandb.mode=online"]) == 0
    err = capfd.readouterr().err
    assert "W&B start failed" in err and "metrics.jsonl has every metric" in err
    assert (run_dir / "summary.json").exists()
    steps = [json.loads(ln)["step"] for ln in open(run_dir / "metrics.jsonl")]
    assert steps == [5, 10, 10, 15, 20, 20]  # log lines, the step-10 eval, the final eval


def test_only_process_0_logs(tmp_path):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "ppgd_tpu", "launch-local", "--processes", "2", "--", "train",
         f"--run_dir={run_dir}", *TINY, "--decomp.steps=10", "--eval.figures=false"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    (only,) = offline_runs(run_dir)
    assert sorted(history(records(glob.glob(f"{only}/run-*.wandb")[0]))) == [5, 10]
