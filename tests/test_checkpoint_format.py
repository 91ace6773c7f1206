"""Checkpoint storage in one process: round trip, commit marker, retention, async save,
digest, verify and the CLI, on local disk and on gs:// (real fake-gcs-server) [C1]-[C4]."""

import json
import logging
import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppgd_tpu.checkpoint import arrays as arrays_io
from ppgd_tpu import storage
from ppgd_tpu import ckpt
from ppgd_tpu.checkpoint import audit
from ppgd_tpu.checkpoint import manifest as mf
from ppgd_tpu.checkpoint.checkpointer import Checkpointer, restore, save
from ppgd_tpu.cmdline import UsageError


def make_state(seed: int = 0) -> dict:
    """Every dtype a train state holds, with bit patterns that a lossy path would change."""
    rng = np.random.default_rng(seed)
    f32 = rng.standard_normal((6, 8)).astype(np.float32)
    f32[0, :3] = [-0.0, np.inf, np.nan]
    return {
        "decomposition/components/linear1/V": jnp.asarray(f32),
        "decomposition/components/linear1/U": jnp.asarray(rng.standard_normal((8, 4)), jnp.bfloat16),
        "decomposition/ci_fn/layers/0/b": jnp.zeros((5,), jnp.float32),  # == fill value
        "training/opt_components/mu/linear1/V": jnp.asarray(rng.standard_normal((6, 8)), jnp.float32),
        "training/adversary/key": jax.random.key_data(jax.random.key(seed)),  # uint32
        "training/adversary/count": jnp.int32(-7),  # 0-d
        "training/replay/ema": jnp.float32(0.125),  # 0-d float
        "training/step": np.int32(1234),  # host numpy leaf
    }


def bits(x) -> bytes:
    x = np.asarray(x)
    return x.dtype.str.encode() + str(x.shape).encode() + np.ascontiguousarray(x).tobytes()


def assert_bitwise(expected: dict, got: dict) -> None:
    assert sorted(got) == sorted(expected)
    for k in expected:
        assert bits(got[k]) == bits(expected[k]), k


@pytest.fixture(params=["local", "gcs"])
def run_dir(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("gcs_emulator").run_dir()


def files_of(run_dir: str, step: int) -> dict[str, int]:
    return storage.list_files(mf.step_dir(run_dir, step))


def test_roundtrip_is_bitwise_with_its_manifest(run_dir):
    state = make_state()
    with Checkpointer(run_dir, config_hash="cfg123") as ckpt:
        ckpt.save(10, state, meta={"note": "hello"})

    host = restore(run_dir)
    assert host.step == 10
    assert_bitwise(state, host.arrays)
    assert host.manifest.config_hash == "cfg123" and host.manifest.meta == {"note": "hello"}
    assert host.manifest.leaves["decomposition/components/linear1/U"].dtype == "bfloat16"
    assert host.manifest.leaves["training/adversary/count"].shape == ()

    device = jax.devices()[0]
    shardings = {k: jax.sharding.SingleDeviceSharding(device) for k in state}
    placed = restore(run_dir, shardings=shardings).arrays
    assert all(isinstance(v, jax.Array) and v.sharding == shardings[k] for k, v in placed.items())
    assert_bitwise(state, placed)

    # [C2] consumers read only the decomposition, to host numpy, with no mesh.
    decomp = restore(run_dir, parts=("decomposition",)).arrays
    assert sorted(decomp) == sorted(k for k in state if k.startswith("decomposition/"))
    assert all(isinstance(v, np.ndarray) for v in decomp.values())

    sdir = mf.step_dir(run_dir, 10)
    assert sorted(storage.list_dirs(sdir)) == ["decomposition", "training"]
    manifest = json.loads(storage.read_bytes(storage.join(sdir, "manifest.json")))
    assert manifest["format_version"] == mf.FORMAT_VERSION and manifest["step"] == 10


def test_incomplete_step_ignored_and_reported_C4(run_dir, caplog):
    state = make_state()
    save(run_dir, 1, state)
    save(run_dir, 2, make_state(1))
    save(run_dir, 3, make_state(2))
    # Step 3 as a dead writer leaves it: no commit marker and a truncated chunk.
    sdir3 = mf.step_dir(run_dir, 3)
    storage.remove(storage.join(sdir3, mf.COMMITTED))
    chunk = storage.join(sdir3, "decomposition/components/linear1/V/c/0/0")
    storage.write_bytes(chunk, storage.read_bytes(chunk)[:10])

    with caplog.at_level(logging.WARNING):
        assert mf.latest_step(run_dir) == 2
    assert "[3]" in caplog.text and "incomplete" in caplog.text
    restored = restore(run_dir)
    assert restored.step == 2
    assert_bitwise(make_state(1), restored.arrays)
    with pytest.raises(FileNotFoundError, match="step 3 .* incomplete"):
        restore(run_dir, step=3)

    listing = audit.ls(run_dir)
    assert [(e.step, e.committed) for e in listing] == [(1, True), (2, True), (3, False)]
    assert all(e.bytes > 0 for e in listing)
    report = {r.step: r for r in audit.verify(run_dir)}
    assert not report[3].committed and not report[3].damaged and report[3].problems
    assert not report[2].problems


def test_retention_keeps_last_n_and_every_C4(tmp_path):
    run_dir = str(tmp_path / "run")
    state = make_state()
    with Checkpointer(run_dir, keep_last_n=2, keep_every=4) as ckpt:
        for step in range(1, 10):
            ckpt.save(step, state)
    assert [e.step for e in mf.list_steps(run_dir)] == [4, 8, 9]


def test_retention_spares_incomplete_until_newer_commit_C4(tmp_path):
    """A save whose write dies (a full disk, as a real file-size limit in a real process):
    nothing older is deleted, the error surfaces on the next call, and once writes work
    again the next save commits and retention removes both."""
    code = f"""
import json, resource, signal, sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
from test_checkpoint_format import make_state
from ppgd_tpu.checkpoint import manifest as mf
from ppgd_tpu.checkpoint.checkpointer import Checkpointer

run_dir, state = {str(tmp_path / "run")!r}, make_state()
with Checkpointer(run_dir, keep_last_n=1) as ckpt:
    ckpt.save(1, state)
    ckpt.save(2, state)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (64, hard))  # the [6, 8] float leaves need more
ckpt = Checkpointer(run_dir, keep_last_n=1)
ckpt.save(3, state)
try:
    ckpt.save(4, state)
    error = None
except RuntimeError as e:
    error = [str(e), str(e.__cause__)]
steps = [(e.step, e.committed) for e in mf.list_steps(run_dir)]
retained = mf.retain(run_dir, keep_last_n=1)
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
ckpt.save(5, state)
ckpt.close()
print(json.dumps({{"error": error, "steps": steps, "retained": retained,
                  "after": [(e.step, e.committed) for e in mf.list_steps(run_dir)]}}))
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["error"] is not None, r
    assert "step 3" in r["error"][0] and "File too large" in r["error"][1], r["error"]
    assert r["steps"] == [[2, True], [3, False]]  # the failed save left step 3 uncommitted
    assert r["retained"] == []  # 3 is newer than the newest commit: kept
    assert r["after"] == [[5, True]]


def test_save_blocks_only_for_host_copy_and_one_in_flight(tmp_path, monkeypatch):
    """save() returns while the write is held back; the snapshot is a host copy, so deleting
    (donating) the device arrays afterwards cannot change what is written; a second save
    waits for the first to commit."""
    run_dir = str(tmp_path / "run")
    release = threading.Event()
    real_write = arrays_io.write_leaves

    def held_write(root, leaves):
        assert release.wait(60)
        real_write(root, leaves)

    monkeypatch.setattr(arrays_io, "write_leaves", held_write)
    expected = make_state()
    state = make_state()
    ckpt = Checkpointer(run_dir, keep_last_n=None)
    ckpt.save(1, state)
    assert not mf.is_committed(mf.step_dir(run_dir, 1))
    for v in state.values():
        if isinstance(v, jax.Array):
            v.delete()
    release.set()
    ckpt.save(2, make_state(1))
    assert mf.is_committed(mf.step_dir(run_dir, 1))  # the first finished before the second began
    ckpt.close()
    assert_bitwise(expected, restore(run_dir, step=1).arrays)
    assert_bitwise(make_state(1), restore(run_dir, step=2).arrays)


@pytest.mark.parametrize("save_ends", ["never", "failing"])
def test_a_failing_command_waits_a_bounded_time_for_its_save_and_keeps_its_own_error(
        tmp_path, monkeypatch, save_ends):
    """Left by an exception (Cloud Storage gone: the save in flight retries for minutes),
    the saver waits ABANDON_AFTER_S at most, leaves that step uncommitted [C4], and the
    command's own error is what propagates, not the save's (it used to wait for the save
    and then raise the save's failure in its place)."""
    from ppgd_tpu.checkpoint import checkpointer

    run_dir = str(tmp_path / "run")
    release = threading.Event()

    def stuck_barrier(name):  # the save is stuck (or fails) after its manifest
        if save_ends == "failing":
            raise OSError("the save's own failure")
        assert release.wait(60)

    monkeypatch.setattr(checkpointer, "ABANDON_AFTER_S", 0.5)
    with pytest.raises(KeyError, match="the command's own error"):
        with Checkpointer(run_dir, keep_last_n=None, barrier=stuck_barrier) as ckpt:
            ckpt.save(1, make_state())
            raise KeyError("the command's own error")
    assert not mf.is_committed(mf.step_dir(run_dir, 1))
    release.set()


def test_a_committed_step_is_never_rewritten(tmp_path):
    run_dir = str(tmp_path / "run")
    save(run_dir, 1, make_state(0))
    save(run_dir, 1, make_state(1))
    assert_bitwise(make_state(0), restore(run_dir).arrays)


def test_digest_is_of_logical_bytes(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    state = make_state()
    save(a, 1, state)
    # The same values as host numpy: different chunk files' origin, same logical state.
    save(b, 7, {k: np.asarray(v) for k, v in state.items()})
    da, db = audit.digest(a), audit.digest(b)
    assert da.overall == db.overall and da.leaves == db.leaves and db.step == 7
    changed = dict(state)
    changed["training/replay/ema"] = jnp.float32(np.nextafter(np.float32(0.125), np.float32(1)))
    save(a, 2, changed)
    d2 = audit.digest(a, step=2)
    assert d2.overall != da.overall
    assert [k for k in d2.leaves if d2.leaves[k] != da.leaves[k]] == ["training/replay/ema"]


def test_verify_finds_damage(run_dir, capsys):
    save(run_dir, 1, make_state())
    assert ckpt.main(["verify", run_dir]) == 0
    sdir = mf.step_dir(run_dir, 1)
    v = storage.join(sdir, "decomposition/components/linear1/V/c/0/0")
    storage.remove(v)  # missing chunk (would silently read as zeros)
    u = storage.join(sdir, "decomposition/components/linear1/U/c/0/0")
    storage.write_bytes(u, storage.read_bytes(u)[:-3])  # truncated chunk
    m = storage.join(sdir, "training/opt_components/mu/linear1/V/c/0/0")
    raw = bytearray(storage.read_bytes(m))
    raw[5] ^= 0x01  # one flipped bit
    storage.write_bytes(m, bytes(raw))
    meta = storage.join(sdir, "training/step/zarr.json")
    zarr = json.loads(storage.read_bytes(meta))
    zarr["shape"] = [2]
    zarr["chunk_grid"]["configuration"]["chunk_shape"] = [2]
    storage.write_bytes(meta, json.dumps(zarr).encode())  # wrong shape
    cut = storage.join(sdir, "training/adversary/count/zarr.json")
    storage.write_bytes(cut, storage.read_bytes(cut)[:20])  # metadata cut short

    [report] = audit.verify(run_dir)
    assert report.damaged
    text = "\n".join(report.problems)
    assert "decomposition/components/linear1/V: missing chunk c/0/0" in text
    for leaf in ["decomposition/components/linear1/U", "training/opt_components/mu/linear1/V",
                 "training/adversary/count", "training/step"]:
        assert f"{leaf}: unreadable" in text, leaf
    assert "tensorstore_spec" not in text  # its kilobyte of spec says nothing to a user
    assert "ci_fn" not in text and "adversary/key" not in text

    src, dst = mf.step_dir(run_dir, 1), mf.step_dir(run_dir, 2)
    for name in storage.list_files(src):  # a step directory copied by hand
        storage.write_bytes(storage.join(dst, name), storage.read_bytes(storage.join(src, name)))
    assert ("manifest is of step 1 (a step directory copied or renamed by hand)"
            in audit.verify(run_dir)[1].problems)

    capsys.readouterr()
    assert ckpt.main(["verify", run_dir]) == 1
    assert "DAMAGED" in capsys.readouterr().out


def test_verify_of_a_running_job_does_not_call_its_deleted_steps_damaged(run_dir, capsys,
                                                                         monkeypatch):
    """A job's retention deletes old steps while `ckpt verify` reads them (1 in 5 verifies of
    a live run said DAMAGED, exit 1): a step un-committed by the time its read failed was
    deleted, not damaged. The deletion is made to land mid-read here, by the job's own
    delete_step."""
    save(run_dir, 1, make_state())
    save(run_dir, 2, make_state())
    read_leaf = audit._leaf_problems

    def the_job_deletes_step_1_meanwhile(sdir, *args):
        if sdir == mf.step_dir(run_dir, 1) and storage.exists(sdir):
            mf.delete_step(sdir)
        return read_leaf(sdir, *args)

    monkeypatch.setattr(audit, "_leaf_problems", the_job_deletes_step_1_meanwhile)
    assert ckpt.main(["verify", run_dir]) == 0
    out = capsys.readouterr().out
    assert "deleted while being verified" in out and "DAMAGED" not in out
    assert [(r.step, r.committed, r.damaged) for r in audit.verify(run_dir)] == [(2, True, False)]


MANIFEST_DAMAGE = {"garbage manifest": b"{not json", "manifest a list": b"[1, 2]",
                   "manifest empty": b""}


@pytest.mark.parametrize("damage", ["missing chunk", "truncated chunk", "chunk metadata cut",
                                    *MANIFEST_DAMAGE, "a leaf without its dtype"])
def test_restore_refuses_a_damaged_committed_step_C4(run_dir, damage, capsys):
    """restore never hands back what was not written: a missing chunk raises (tensorstore
    would fill it with zeros), as do a cut-short chunk and a manifest that is not one
    (unparsable, JSON but not an object: an AttributeError traceback on resume before, a
    leaf entry cut short: a KeyError from `ckpt digest`); `ckpt digest` names the file."""
    save(run_dir, 1, make_state())
    sdir = mf.step_dir(run_dir, 1)
    manifest = storage.join(sdir, mf.MANIFEST)
    chunk = storage.join(sdir, "decomposition/components/linear1/V/c/0/0")
    if damage == "missing chunk":
        storage.remove(chunk)
    elif damage == "truncated chunk":
        storage.write_bytes(chunk, storage.read_bytes(chunk)[:-3])
    elif damage == "chunk metadata cut":
        meta = storage.join(sdir, "decomposition/components/linear1/V/zarr.json")
        storage.write_bytes(meta, storage.read_bytes(meta)[:20])
    elif damage in MANIFEST_DAMAGE:
        storage.write_bytes(manifest, MANIFEST_DAMAGE[damage])
    else:
        d = json.loads(storage.read_bytes(manifest))
        del d["leaves"]["decomposition/components/linear1/V"]["dtype"]
        storage.write_bytes(manifest, json.dumps(d).encode())
    is_damaged = (f"{sdir}/manifest.json is damaged" if "chunk" not in damage
                  else f"committed checkpoint {sdir} is damaged")
    with pytest.raises(mf.DamagedCheckpoint, match=is_damaged) as refused:
        restore(run_dir, 1)
    assert str(refused.value).count("delete") == 1  # the way out, once (it was wrapped twice)
    assert "tensorstore_spec" not in str(refused.value)
    capsys.readouterr()
    assert ckpt.main(["digest", run_dir]) == 1  # damage found, as verify says it (was 2: usage)
    err = capsys.readouterr().err
    assert "lists all the damage" in err and "Traceback" not in err
    assert "tensorstore_spec" not in err
    if "chunk" not in damage:
        assert f"{manifest} is damaged" in err
        assert f"delete {sdir} to resume from the checkpoint before it" in err
    else:
        assert f"{sdir}/decomposition/components/linear1/V is damaged: " in err, err


def test_cli_ls_digest_and_bad_paths(run_dir, capsys):
    save(run_dir, 3, make_state())
    assert ckpt.main(["ls", run_dir]) == 0
    out = capsys.readouterr().out
    assert "committed" in out and mf.step_dir(run_dir, 3) in out
    assert ckpt.main(["digest", run_dir, "--step", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"{audit.digest(run_dir).overall}  step 3 overall"
    assert len(out) == len(make_state()) + 1

    for bad in [run_dir + "/nothing-here", "s3://bucket/run", "gs:///run"]:
        assert ckpt.main(["ls", bad]) == 2
        assert "ppgd-tpu ckpt ls:" in capsys.readouterr().err
    fresh = storage.join(run_dir, "fresh")  # a run that has not saved yet
    storage.write_bytes(storage.join(fresh, "config.yaml"), b"name: x\n")
    assert ckpt.main(["ls", fresh]) == 2
    assert f"{fresh} is a run directory with no checkpoint yet" in capsys.readouterr().err
    for inside in (mf.ckpts_dir(run_dir), mf.step_dir(run_dir, 3)):  # one level too deep
        assert ckpt.main(["ls", inside]) == 2
        assert f"give its run directory, {storage.normalize(run_dir)}" in capsys.readouterr().err
    assert ckpt.main(["digest", run_dir, "--step", "4"]) == 2
    assert "step 4" in capsys.readouterr().err
    with pytest.raises(UsageError, match="'frobnicate': not a tool; one of ls, digest, verify"):
        ckpt.main(["frobnicate", run_dir])
    if storage.is_gcs(run_dir):  # (gs:// has no empty directories)
        return
    empty = run_dir + "/empty"  # a run dir whose ckpts/ holds no step: exit 0, said nothing
    os.makedirs(mf.ckpts_dir(empty))
    for cmd in ("ls", "verify", "digest"):
        assert ckpt.main([cmd, empty]) == 2
        assert f"{mf.ckpts_dir(empty)} holds no checkpoint" in capsys.readouterr().err


def test_bad_leaves_are_refused_by_name(tmp_path):
    run_dir = str(tmp_path / "run")
    x = jnp.zeros((2,))
    with pytest.raises(ValueError, match="'components/V' must start with one of"):
        save(run_dir, 1, {"components/V": x})
    with pytest.raises(ValueError, match="'training/a' is a prefix of leaf path 'training/a/b'"):
        save(run_dir, 1, {"training/a": x, "training/a/b": x})
    with pytest.raises(ValueError, match=r"\['..'\]"):
        save(run_dir, 1, {"training/../x": x})
    with pytest.raises(TypeError, match="'training/key'.*key_data"):
        save(run_dir, 1, {"training/key": jax.random.key(0)})
    save(run_dir, 1, {"training/a": x, "decomposition/b": x})
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(ValueError, match=r"missing \['training/a'\].*not in checkpoint \['training/zz'\]"):
        restore(run_dir, shardings={"decomposition/b": sharding, "training/zz": sharding})
    with pytest.raises(ValueError, match="unknown checkpoint part"):
        restore(run_dir, parts=("decomp",))
