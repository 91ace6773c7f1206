"""Checkpoints across meshes and processes [C3][C4]: saved from 4 forced CPU devices (and from
2 real JAX processes over gloo), restored onto 1 device, host numpy, or a different mesh;
a writer SIGKILLed mid-save leaves the previous checkpoint restorable.

Multi-device runs happen in subprocesses (this file is also the worker script), so the device
count never depends on what the pytest process imported first.
"""

import itertools
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The global state and, per leaf, how the writer shards it over mesh axes ("a", "b").
WRITE_SPECS = {
    "decomposition/components/linear1/V": ("a", "b"),
    "decomposition/components/linear1/U": ("a", None),
    "training/opt_components/mu/linear1/V": (None, "b"),
    "training/adversary/key": (None, None),  # replicated: written once, by replica 0
    "training/step": (),
}
# A different layout to restore onto.
READ_SPECS = {
    "decomposition/components/linear1/V": ("b", "a"),
    "decomposition/components/linear1/U": (None, ("a", "b")),
    "training/opt_components/mu/linear1/V": ("a", None),
    "training/adversary/key": ("a", None),
    "training/step": (),
}


def global_state(offset: int = 0) -> dict:
    import ml_dtypes

    rng = np.random.default_rng(42 + offset)
    return {
        "decomposition/components/linear1/V": rng.standard_normal((8, 12)).astype(np.float32),
        "decomposition/components/linear1/U": rng.standard_normal((12, 8)).astype(ml_dtypes.bfloat16),
        "training/opt_components/mu/linear1/V": rng.standard_normal((8, 12)).astype(np.float32),
        "training/adversary/key": rng.integers(0, 2**32, (4, 2), dtype=np.uint32),
        "training/step": np.int32(100 + offset),
    }


def bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ----------------------------------------------------------------------------- worker side


def _mesh(shape):
    import jax

    return jax.make_mesh(tuple(shape), ("a", "b"), devices=jax.devices())


def _shardings(mesh, specs):
    import jax

    return {k: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*s)) for k, s in specs.items()}


def _place(state, shardings):
    import jax

    return {
        k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
        for k, v in state.items()
    }


def _check_restored(run_dir, mesh, specs, offset):
    """Restore onto `specs` and check every addressable shard bitwise against the truth."""
    from ppgd_tpu.checkpoint.checkpointer import restore

    expected = global_state(offset)
    restored = restore(run_dir, shardings=_shardings(mesh, specs))
    for k, arr in restored.arrays.items():
        assert arr.sharding.spec == _shardings(mesh, specs)[k].spec, k
        for shard in arr.addressable_shards:
            assert bits_equal(shard.data, expected[k][shard.index]), (k, shard.index)
    return restored.step


def worker(mode: str, args: dict) -> None:
    import jax

    from ppgd_tpu.checkpoint import arrays as arrays_io
    from ppgd_tpu.checkpoint.checkpointer import Checkpointer

    barrier = None
    if mode == "multiprocess":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{args['port']}", 2, args["process_id"])
        from jax._src import distributed

        def wait_at_barrier(name):
            distributed.global_state.client.wait_at_barrier(name, 120_000)

        barrier = wait_at_barrier

    written = {}  # leaf -> [[start, stop] per dim] of every piece this process writes
    if mode == "multiprocess":
        real_write_leaves = arrays_io.write_leaves

        def recording_write_leaves(root, leaves):
            for name, leaf in leaves.items():
                written.setdefault(name, []).extend(
                    [[s.start, s.stop] for s in index] for index, _ in leaf.pieces)
            real_write_leaves(root, leaves)

        arrays_io.write_leaves = recording_write_leaves

        # Process 0 commits late, so a process whose save returns before the commit marker
        # exists finds no checkpoint to read back below (the race CI once lost by chance).
        from ppgd_tpu.checkpoint import manifest as mf

        real_commit = mf.commit

        def late_commit(sdir):
            time.sleep(3)
            real_commit(sdir)

        mf.commit = late_commit

    mesh = _mesh(args["mesh"])
    state = _place(global_state(), _shardings(mesh, WRITE_SPECS))
    ckpt = Checkpointer(args["run_dir"], barrier=barrier, keep_last_n=None)
    ckpt.save(args["step"], state)

    if mode == "kill":
        ckpt.wait()  # step committed; now die in the middle of writing the next one
        real_write = arrays_io.write_leaves

        def write_first_leaf_then_die(root, leaves):
            first = sorted(leaves)[0]
            real_write(root, {first: leaves[first]})
            os.kill(os.getpid(), signal.SIGKILL)

        arrays_io.write_leaves = write_first_leaf_then_die
        ckpt.save(args["step"] + 1, _place(global_state(1), _shardings(mesh, WRITE_SPECS)))
        ckpt.wait()
        raise AssertionError("the writer should have been killed")
    ckpt.close()
    if mode == "multiprocess":
        print("WRITTEN " + json.dumps(written), flush=True)
        # Every process reads back only what its devices need, on another layout.
        assert _check_restored(args["run_dir"], mesh, READ_SPECS, 0) == args["step"]
        barrier("test/restored")
    for shape in args.get("restore_meshes", []):
        assert _check_restored(args["run_dir"], _mesh(shape), READ_SPECS, 0) == args["step"]
    print("WORKER OK", flush=True)


# ----------------------------------------------------------------------------- test side


def spawn(mode: str, args: dict, devices: int) -> subprocess.Popen:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), mode, json.dumps(args)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=240)
    return proc.returncode, out


def run_ok(mode: str, args: dict, devices: int) -> None:
    rc, out = finish(spawn(mode, args, devices))
    assert rc == 0 and "WORKER OK" in out, out


def assert_state(restored: dict, offset: int = 0) -> None:
    expected = global_state(offset)
    assert sorted(restored) == sorted(expected)
    for k in expected:
        assert bits_equal(restored[k], expected[k]), k


def test_sharded_save_restores_on_any_mesh_C4(tmp_path):
    from ppgd_tpu.checkpoint import audit
    from ppgd_tpu.checkpoint.checkpointer import restore, save

    run_dir = str(tmp_path / "sharded")
    run_ok("save", {"run_dir": run_dir, "mesh": [2, 2], "step": 5, "restore_meshes": [[4, 1], [2, 2]]}, 4)

    restored = restore(run_dir)  # here: host numpy, no mesh
    assert restored.step == 5 and restored.manifest.mesh == {"axis_names": ["a", "b"], "shape": [2, 2]}
    assert_state(restored.arrays)
    assert restored.manifest.leaves["decomposition/components/linear1/V"].chunks == (4, 6)

    import jax

    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    on_one = restore(run_dir, shardings={k: one for k in WRITE_SPECS}).arrays
    assert_state({k: np.asarray(v) for k, v in on_one.items()})

    # The digest is of the logical state, not of how a mesh chunked it.
    single = str(tmp_path / "single")
    save(single, 5, global_state())
    assert restore(single).manifest.leaves["decomposition/components/linear1/V"].chunks == (8, 12)
    assert audit.digest(single).overall == audit.digest(run_dir).overall
    assert not any(r.problems for r in audit.verify(run_dir))


def test_sigkill_mid_write_keeps_previous_checkpoint_C4(tmp_path):
    from ppgd_tpu.checkpoint import audit
    from ppgd_tpu.checkpoint import manifest as mf
    from ppgd_tpu import storage
    from ppgd_tpu.checkpoint.checkpointer import restore, save

    run_dir = str(tmp_path / "run")
    rc, out = finish(spawn("kill", {"run_dir": run_dir, "mesh": [2, 2], "step": 1}, 4))
    assert rc == -signal.SIGKILL, out
    # Step 2 got its manifest and one leaf, then its writer died.
    assert [(e.step, e.committed) for e in mf.list_steps(run_dir)] == [(1, True), (2, False)]
    assert storage.exists(storage.join(mf.step_dir(run_dir, 2), "manifest.json"))
    restored = restore(run_dir)
    assert restored.step == 1
    assert_state(restored.arrays)
    assert [r.damaged for r in audit.verify(run_dir)] == [False, False]

    # A new attempt at step 2 clears the dead one's leftovers and commits.
    save(run_dir, 2, global_state(1), keep_last_n=1)
    assert [(e.step, e.committed) for e in mf.list_steps(run_dir)] == [(2, True)]
    assert_state(restore(run_dir).arrays, offset=1)


def _written(out: str) -> dict:
    """The worker's WRITTEN line: {leaf: [[[start, stop] per dim] per piece written]}."""
    lines = [ln for ln in out.splitlines() if ln.startswith("WRITTEN ")]
    assert len(lines) == 1, out
    return json.loads(lines[0][len("WRITTEN "):])


def _grid(shape, chunks) -> tuple[int, ...]:
    return tuple(-(-d // c) for d, c in zip(shape, chunks))


def _chunks_of(pieces, shape, chunks) -> set:
    """The chunk grid positions the pieces cover; each piece must be whole chunks, else two
    writers of one chunk would race on its read-modify-write."""
    out = set()
    for piece in pieces:
        ranges = []
        for (start, stop), d, c in zip(piece, shape, chunks):
            assert start % c == 0 and (stop % c == 0 or stop == d), (piece, shape, chunks)
            ranges.append(range(start // c, -(-stop // c)))
        out |= set(itertools.product(*ranges))  # a scalar leaf: the one position ()
    return out


def _stored_chunks(leaf_dir: str) -> set:
    """The chunk grid positions with an object under a zarr3 array (keys c/i/j..., c)."""
    from ppgd_tpu import storage

    keys = [k for k in storage.list_files(leaf_dir) if k == "c" or k.startswith("c/")]
    return {tuple(int(i) for i in k.split("/")[1:]) for k in keys}


def test_two_processes_write_own_shards_to_gcs_C4(gcs_emulator, tmp_path):
    """2 JAX processes x 2 devices over gloo each write only their shards to gs://, commit
    once via a barrier; once its save returns, each (even while process 0 is slow to commit)
    reads back its own slices on another layout; one process with no mesh reads the whole
    state, with the same digest as a single-process save."""
    from ppgd_tpu.checkpoint import audit
    from ppgd_tpu.checkpoint.checkpointer import restore, save
    from ppgd_tpu.launch_local import free_port

    run_dir = gcs_emulator.run_dir()
    port = free_port()
    procs = [
        spawn("multiprocess", {"run_dir": run_dir, "mesh": [2, 2], "step": 3, "port": port, "process_id": i}, 2)
        for i in range(2)
    ]
    results = [finish(p) for p in procs]
    assert all(rc == 0 and "WORKER OK" in out for rc, out in results), "\n".join(
        f"--- process {i} (rc {rc}):\n{out}" for i, (rc, out) in enumerate(results))

    restored = restore(run_dir)
    assert restored.step == 3 and restored.manifest.process_count == 2
    assert_state(restored.arrays)

    # Each process wrote only its own chunks: what each handed to the writer (recorded in the
    # worker) is whole chunks, no chunk from both processes, and together every chunk of every
    # leaf -- which is also exactly the chunk objects stored on gs://.
    written = [_written(out) for _, out in results]
    sdir = f"{run_dir}/ckpts/3"
    for name, info in restored.manifest.leaves.items():
        grid = {tuple(c) for c in np.ndindex(*_grid(info.shape, info.chunks))}
        mine = [_chunks_of(w.get(name, []), info.shape, info.chunks) for w in written]
        assert not mine[0] & mine[1], (name, "written by both processes", mine[0] & mine[1])
        assert mine[0] | mine[1] == grid, (name, mine, grid)
        assert _stored_chunks(f"{sdir}/{name}") == grid, name
    sharded = "decomposition/components/linear1/V"  # 4 chunks over 2 processes x 2 devices
    assert [len(_chunks_of(w[sharded], (8, 12), (4, 6))) for w in written] == [2, 2]
    single = str(tmp_path / "single")
    save(single, 3, global_state())
    assert audit.digest(single).overall == audit.digest(run_dir).overall


if __name__ == "__main__":
    worker(sys.argv[1], json.loads(sys.argv[2]))
