"""Process-level settings for running XLA:CPU well, applied by the `ppgd-tpu` entry point
before JAX starts. Each was measured with `ppgd-tpu bench step` on the toy configs.

- Host allocator: XLA:CPU allocates every step's temporaries with malloc. glibc serves
  blocks above its mmap threshold (128 KiB, adapting up to 32 MiB) with fresh mmaps and
  unmaps them on free, so each step page-faults and zeroes its whole working set again
  (40% of a TMS 5-2 step: 25 ms -> 15 ms). Raising the mmap and trim thresholds keeps those
  blocks in the heap, reused step after step.
- XLA:CPU's YNN reduction fusions take only materialised operands, so every elementwise
  producer of a reduction (the per-component CI MLP's [B, C, h] hidden layer) is written to
  memory first; without them XLA fuses producer and reduction (-20% CPU time on TMS 5-2).

Both are skipped when the user set them (MALLOC_* variables; the flag in XLA_FLAGS).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
KEEP_BELOW = 1 << 30  # blocks under 1 GiB stay in the heap; larger ones are mmapped
YNN_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
XLA_CPU_FLAGS = (f"{YNN_FLAG}=-reduce",)


def keep_step_buffers() -> bool:
    """Sets glibc's mmap/trim thresholds unless MALLOC_* is set or the C library is not
    glibc; returns whether they were set."""
    if any(k.startswith("MALLOC_") for k in os.environ):
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, KEEP_BELOW) and mallopt(_M_TRIM_THRESHOLD, KEEP_BELOW))


def add_xla_cpu_flags(env=os.environ) -> None:
    """Appends XLA_CPU_FLAGS to XLA_FLAGS (must run before JAX initialises its backends);
    flags the user set win. CPU-only flags: accelerator backends ignore them."""
    current = env.get("XLA_FLAGS", "")
    extra = [f for f in XLA_CPU_FLAGS if f.split("=")[0] not in current]
    if extra:
        env["XLA_FLAGS"] = " ".join([current, *extra]).strip()


def configure() -> None:
    keep_step_buffers()
    add_xla_cpu_flags()
