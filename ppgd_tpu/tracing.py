"""What a program is traced FOR: the mesh it will run on, hence its platform and where its
activations live.

A run's programs are traced (at their first call, or by `.lower()`) inside `for_mesh(mesh)`
(`traced_on`, used by every jit of a run: programs.py, replay.py). Code below the entry
point asks this module, never JAX's default backend or device list, so that a TPU program
traced on a CPU host (`ppgd-tpu compile`: the devices of a TPU topology) is the program a
TPU host traces:

- `platform()`: the mesh's device platform ("cpu", "tpu", "gpu"), or JAX's default backend
  outside a run's programs. Platform-specific code paths (decomp/live_rows.py, rng's paired
  draws, component_mlp's row chunks) read it.
- `shard_rows(x)`: pins dim 0 of an activation to the batch axes (mesh.BATCH_AXES), the
  rest replicated [D1]. Under FSDP the weights are sharded on their embed dim, the one a
  matmul contracts over, and without the pin XLA's propagation may split the contraction
  instead of the batch, so every chip computes the whole global batch (TPU_AOT_TRIAL.md).
  The targets and CI fns call it at their block boundaries; it is the identity outside a
  run's programs, on a one-device mesh, or when the rows do not divide over the shards.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
from jax.sharding import NamedSharding, PartitionSpec

BATCH_AXES = ("data", "fsdp")  # the mesh axes batch rows are split over (mesh.py's rule)

_MESH: contextvars.ContextVar = contextvars.ContextVar("ppgd_tpu_traced_for", default=None)


@contextlib.contextmanager
def for_mesh(mesh):
    """Traces inside this block are for `mesh` (a jax.sharding.Mesh, or None: no mesh)."""
    token = _MESH.set(mesh)
    try:
        yield
    finally:
        _MESH.reset(token)


def traced_on(mesh, fn):
    """`fn` traced for `mesh` whenever it runs (wrap a function before jitting it)."""
    if mesh is None:
        return fn

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with for_mesh(mesh):
            return fn(*args, **kwargs)

    return traced


def mesh():
    """The mesh of the program being traced, or None."""
    return _MESH.get()


def platform() -> str:
    """The platform the program being traced will run on."""
    m = _MESH.get()
    if m is None:
        return jax.default_backend()
    return m.devices.flat[0].platform


def shard_rows(x):
    """`x` with dim 0 on the batch axes of the traced program's mesh (see the module doc)."""
    m = _MESH.get()
    if m is None or m.size == 1 or x.ndim == 0:
        return x
    n = math.prod(m.shape[a] for a in BATCH_AXES)
    if n == 1 or x.shape[0] % n:
        return x
    return jax.lax.with_sharding_constraint(x, NamedSharding(m, PartitionSpec(BATCH_AXES)))
