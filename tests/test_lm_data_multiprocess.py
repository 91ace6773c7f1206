"""LM batches over 2 real JAX processes (gloo) [D1, D3]: each process reads only its
contiguous slice of global batch j, and the assembled global array is the batch one process
would read alone; a batch that does not divide over the processes is refused by field.

This file is also the worker script (multi-process runs happen in subprocesses)."""

import json
import os
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(args: dict) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{args['port']}", 2, args["process_id"])
    from jax.experimental import multihost_utils

    from ppgd_tpu.config import ConfigError, load
    from ppgd_tpu.data.lm import LMData
    from ppgd_tpu.data.tokens import TokenStore

    over = {"target.kind": "llama_simple_mlp", "target.llama_simple_mlp.max_seq_len": 32,
            "data.store": args["store"], "data.batch_size": 8, "data.eval_rows": 16,
            "eval.batch_size": 4}
    data = LMData(load(None, over))
    store = TokenStore.open(args["store"])
    pi = jax.process_index()
    for j in (0, 5):
        x = data.batch(j)
        expected = store.read_rows(data.train.rows(j))[:, :-1]
        assert x.shape == (8, 16) and not x.is_fully_addressable
        local = np.concatenate([np.asarray(s.data) for s in x.addressable_shards])
        np.testing.assert_array_equal(local, expected[4 * pi:4 * pi + 4])
        np.testing.assert_array_equal(multihost_utils.process_allgather(x, tiled=True),
                                      expected)
        total = jax.jit(lambda a: a.sum())(x)  # a usable jit input; the sum is replicated
        assert int(total.addressable_shards[0].data) == int(expected.sum())
    assert data.eval_batch.shape == (4, 16) and data.eval_labels.shape == (4, 16)
    try:
        LMData(load(None, {**over, "data.batch_size": 5}))
        raise AssertionError("batch 5 over 2 processes was accepted")
    except ConfigError as e:
        assert "data.batch_size: 5 does not divide over 2 processes" in str(e), e
    print("WORKER OK", flush=True)


def test_two_processes_read_their_own_rows_of_the_global_batch(tmp_path):
    from ppgd_tpu.data import tokenize
    from ppgd_tpu.launch_local import free_port

    (tmp_path / "doc.txt").write_text("the cat sat on a mat. " * 200)
    store = str(tmp_path / "store")
    assert tokenize.main(["--input", str(tmp_path / "doc.txt"), "--output", store,
                          "--seq_len", "17"]) == 0
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen(
        [sys.executable, os.path.abspath(__file__),
         json.dumps({"port": port, "process_id": i, "store": store})],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    for p in procs:
        out, _ = p.communicate(timeout=240)
        assert p.returncode == 0 and "WORKER OK" in out, out


if __name__ == "__main__":
    worker(json.loads(sys.argv[1]))
