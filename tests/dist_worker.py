"""Child program for the multi-process tests of ppgd_tpu.dist (run one per process).

    python tests/dist_worker.py collectives      # print cross-process results as JSON
    python tests/dist_worker.py loop             # toy training loop with StopSignal [C5]
    python tests/dist_worker.py lost_raise       # a start-up SIGINT whose raise is lost
    python tests/dist_worker.py finished         # signals after the work is done
    python tests/dist_worker.py teardown         # a signal once the interpreter tears down

Bring-up comes from the PPGD_* environment, exactly as under `ppgd-tpu launch-local`.
Lines starting with RESULT carry JSON for the test to check.
"""

import collections
import json
import os
import signal
import sys
import time

import numpy as np
from absl import logging

from ppgd_tpu import dist


def result(**kw):
    print("RESULT " + json.dumps(kw), flush=True)


def global_vector(mesh, per_device):
    """A [n_devices] array sharded one element per device; this process supplies its own."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    sharding = NamedSharding(mesh, P("d"))
    n = len(mesh.devices.flat)
    return jax.make_array_from_callback(
        (n,), sharding, lambda idx: np.asarray([per_device[idx[0].start]], np.float32)
    )


def collectives():
    import jax
    import jax.numpy as jnp
    from jax.experimental import multihost_utils

    dist.initialize()
    me = dist.process_index()
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    # Device k holds k + 1, so the global sum is n(n+1)/2 whatever process owns what.
    vec = global_vector(mesh, [float(k + 1) for k in range(jax.device_count())])
    total = jax.jit(jnp.sum)(vec)  # a reduction across both processes' devices
    gathered = multihost_utils.process_allgather(np.asarray([me * 10 + 1], np.int32))
    dist.barrier("collectives")
    logging.warning("a tagged line")
    result(
        process=me,
        count=dist.process_count(),
        tag=dist.tag(),
        is_main=dist.is_main(),
        devices=jax.device_count(),
        local_devices=jax.local_device_count(),
        total=float(total),
        gathered=np.asarray(gathered).ravel().tolist(),
        broadcast=dist.broadcast_from_main({"run": f"run-from-p{me}", "save": me == 0}),
        gather=dist.gather_from_all(f"p{me}"),
    )


def loop():
    """Steps with a cross-process collective each; stops where the others stop, then a
    'save' that lasts until a SIGINT arrives, which must be noted, not fatal."""
    import jax
    import jax.numpy as jnp

    dist.initialize()
    me = dist.process_index()
    stop = dist.StopSignal()
    mesh = jax.make_mesh((jax.device_count(),), ("d",))
    vec = global_vector(mesh, [0.0] * jax.device_count())

    @jax.jit
    def step(v):
        return 0.5 * v + 0.01 * jnp.sum(v) + 1.0  # jnp.sum crosses processes

    # JAX 0.10 CPU + gloo deadlocks with >~16 collective steps in flight and 2 devices per
    # process, so like a real loop (which syncs at log steps) bound the dispatch queue.
    inflight = collections.deque()
    for i in range(1, 10**9):
        vec = step(vec)
        inflight.append(vec)
        if len(inflight) > 8:
            inflight.popleft().block_until_ready()
        if i == 5:
            print(f"RUNNING p{me}", flush=True)
        if stop.should_stop(i):
            break
    checksum = float(jax.jit(jnp.sum)(vec))  # equal only if both ran the same steps
    print(f"SAVING p{me}", flush=True)
    while "SIGINT" not in stop.signals_received:
        time.sleep(0.01)
    dist.barrier("saved")
    stop.close()
    result(process=me, stop_step=stop.stop_step, checksum=checksum,
           signals=stop.signals_received, reason=stop.reason)


def lost_raise():
    """A SIGINT that arrives during a gc callback before the loop (JAX registers one): the
    handler's raise is ignored there, yet the StopSignal stops at its first boundary."""
    import gc

    from ppgd_tpu import signals

    signals.install()
    fired = []

    def signal_during_gc(phase, info):
        if not fired:
            fired.append(phase)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)  # the handler runs in this frame: its raise is lost

    gc.callbacks.append(signal_during_gc)
    gc.collect()
    gc.callbacks.remove(signal_during_gc)
    print(f"STILL RUNNING after {signals.seen}", flush=True)
    dist.initialize()
    with dist.StopSignal() as stop:
        result(first_call_stops=stop.should_stop(0), reason=stop.reason)


def finished():
    """After signals.finished(), a real SIGTERM is noted, not raised; a second one raises."""
    from ppgd_tpu import signals

    signals.install()
    signals.finished()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)
    print("NOTED", signals.seen, flush=True)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
    except signals.Terminated:
        result(second_raised=True, seen=signals.seen)


class _SignalAtTeardown:
    """Sends this process a SIGTERM from its own finalizer: once the interpreter has
    cleared the signal module (and `os`), so everything it uses is bound beforehand."""

    def __del__(self, kill=os.kill, pid=os.getpid(), term=signal.SIGTERM, sleep=time.sleep,
                write=os.write):
        kill(pid, term)
        sleep(0.2)  # the signal is delivered meanwhile
        write(1, b"SURVIVED\n")


def teardown():
    """A run that is done, JAX's own exit handlers registered, and a SIGTERM while the
    interpreter tears down (after Python's own handlers are gone)."""
    from ppgd_tpu import signals

    signals.install()
    dist.initialize()
    dist.barrier("up")
    signals.finished()
    globals()["_at_teardown"] = _SignalAtTeardown()
    result(done=True)


if __name__ == "__main__":
    {"collectives": collectives, "loop": loop, "lost_raise": lost_raise,
     "finished": finished, "teardown": teardown}[sys.argv[1]](
        *sys.argv[2:])
