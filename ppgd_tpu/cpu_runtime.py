"""Process-level settings for running XLA:CPU well (each measured with `ppgd-tpu bench
step` on the toy configs: docs/performance-log.md).

- Host allocator: XLA:CPU allocates every step's temporaries with malloc. glibc serves
  blocks above its mmap threshold (128 KiB, adapting up to 32 MiB) with fresh mmaps and
  unmaps them on free, so each step would page-fault and zero its whole working set again.
  Raising the mmap and trim thresholds keeps those blocks in the heap, reused step after
  step.
- XLA:CPU's YNN reduction fusions take only materialised operands, so every elementwise
  producer of a reduction (the per-component CI MLP's [B, C, h] hidden layer) is written to
  memory first; without them XLA fuses producer and reduction. Its single dots are slower
  than XLA:CPU's own (Eigen) on the toys' skinny matmuls ([4096, 5] x [5, 20]); both are
  turned off (XLA_CPU_FLAGS).

The XLA flag changes how sums are fused and dots computed, hence float results: `configure`
sets it (and JAX_PLATFORMS where libtpu is installed on a host without a TPU) in the
`ppgd-tpu` entry point before JAX is imported, and in tests/conftest.py; a Python user calls
it as `ppgd_tpu.configure_cpu()`, so the CLI, the Python API and tests compile the same
programs and resume bitwise [C3]. Importing `ppgd_tpu` sets nothing. The allocator setting
changes no result and is made by the entry point only. Both are skipped when the user set
them (MALLOC_* variables; the flag in XLA_FLAGS); the flag also on hosts with an
accelerator plugin, where JAX does not compute on CPU.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
import warnings

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_BELOW = 1 << 30  # blocks under 1 GiB stay in the heap; larger ones are mmapped
YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
XLA_CPU_FLAGS = (f"{YNN_FLAG}=-reduce,-individual_dot",)


def keep_step_buffers() -> bool:
    """Sets glibc's mmap/trim thresholds unless MALLOC_* is set or the C library is not
    glibc; returns whether they were set."""
    if any(k.startswith("MALLOC_") for k in os.environ):
        return False
    import ctypes.util  # here: it imports subprocess, which `import ppgd_tpu` need not pay

    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BELOW) and mallopt(_M_TRIM_THRESHOLD, KEEP_BELOW))


ACCELERATOR_PLUGINS = ("libtpu", "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin")


# Device nodes of a TPU host: /dev/accel* (v2-v4, v5p), /dev/vfio/<n> (v5e, v6e).
TPU_DEVICE_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*")


def tpu_attached() -> bool:
    return any(glob.glob(p) for p in TPU_DEVICE_NODES)


def _plugins() -> list[str]:
    return [m for m in ACCELERATOR_PLUGINS if importlib.util.find_spec(m)]


def computes_on_cpu(env=os.environ) -> bool:
    """Whether JAX will compute on XLA:CPU: JAX_PLATFORMS says cpu, no accelerator plugin
    is installed, or only libtpu is and no TPU is attached (the `tpu` extra on a CPU host,
    for `ppgd-tpu compile`). (On a TPU/GPU host the flags would not matter, and an older
    plugin's XLA could refuse a flag it does not know.)"""
    if env.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
        return True
    plugins = _plugins()
    return not plugins or (plugins == ["libtpu"] and not tpu_attached())


def skip_tpu_probe(env=os.environ) -> None:
    """With libtpu installed on a host without a TPU, JAX would try (and fail) to start a
    TPU backend in every process, printing libtpu's errors: JAX_PLATFORMS=cpu says where
    it computes instead. (libtpu's compiler stays usable: `ppgd-tpu compile` asks it for a
    topology's devices directly.) A JAX_PLATFORMS the user set is kept."""
    if "JAX_PLATFORMS" not in env and _plugins() == ["libtpu"] and not tpu_attached():
        env["JAX_PLATFORMS"] = "cpu"


def add_xla_cpu_flags(env=os.environ) -> None:
    """Appends XLA_CPU_FLAGS to XLA_FLAGS when JAX computes on CPU; flags the user set win.
    Warns when JAX's backends already exist (the flags then do not apply, and this
    process's CPU numerics differ from a `ppgd-tpu` run's)."""
    if not computes_on_cpu(env):
        return
    current = env.get("XLA_FLAGS", "")
    extra = [f for f in XLA_CPU_FLAGS if f.split("=")[0] not in current]
    if not extra:
        return
    env["XLA_FLAGS"] = " ".join([current, *extra]).strip()
    if env is os.environ and "jax" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            warnings.warn("ppgd_tpu.configure_cpu() called after JAX created its backends: "
                          f"XLA_FLAGS {' '.join(extra)} not applied; call it before JAX "
                          "computes for results bitwise comparable with `ppgd-tpu` runs",
                          stacklevel=4)


def configure(env=os.environ) -> None:
    """The process's XLA:CPU setup, before JAX is imported: skip_tpu_probe, then
    add_xla_cpu_flags (`ppgd_tpu.configure_cpu()`; the `ppgd-tpu` entry point)."""
    skip_tpu_probe(env)
    add_xla_cpu_flags(env)
