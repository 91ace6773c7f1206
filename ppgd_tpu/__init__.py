"""ppgd_tpu: rank-1 parameter decomposition of frozen networks (SPEC.md)."""

from importlib import metadata as _metadata

try:  # one source of truth: pyproject.toml, as installed (launch/tpu_pod.sh reads it too)
    __version__ = _metadata.version("ppgd-tpu")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"

from ppgd_tpu import cpu_runtime as _cpu_runtime

_cpu_runtime.add_xla_cpu_flags()  # before JAX creates its backends: same programs everywhere


def load_decomposition(run_dir: str):
    """Final components of a run as numpy: {site: {"V": [d_in, C], "U": [C, d_out]}}."""
    from ppgd_tpu.engine import load_decomposition as load

    return load(run_dir)
