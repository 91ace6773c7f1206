"""ppgd_tpu: rank-1 parameter decomposition of frozen networks (SPEC.md)."""

from ppgd_tpu import cpu_runtime as _cpu_runtime

_cpu_runtime.add_xla_cpu_flags()  # before JAX creates its backends: same programs everywhere


def load_decomposition(run_dir: str):
    """Final components of a run as numpy: {site: {"V": [d_in, C], "U": [C, d_out]}}."""
    from ppgd_tpu.engine import load_decomposition as load

    return load(run_dir)


def __getattr__(name: str):
    """`__version__`, read when asked: importlib.metadata costs the CLI's start-up (its
    signal handlers wait for this package's import) ~25 ms."""
    if name != "__version__":
        raise AttributeError(f"module 'ppgd_tpu' has no attribute {name!r}")
    from importlib import metadata

    try:  # one source of truth: pyproject.toml, as installed (launch/tpu_pod.sh reads it too)
        return metadata.version("ppgd-tpu")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"
