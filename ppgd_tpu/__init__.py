"""ppgd_tpu: rank-1 parameter decomposition of frozen networks (SPEC.md)."""

from ppgd_tpu import cpu_runtime as _cpu_runtime

_cpu_runtime.skip_tpu_probe()  # the `tpu` extra on a CPU host: compute on CPU, no probe
_cpu_runtime.add_xla_cpu_flags()  # before JAX creates its backends: same programs everywhere


__all__ = ["load_decomposition", "load_run"]


def __getattr__(name: str):
    """`load_decomposition` (the consumer API: a run's final components as numpy,
    {site: {"V": [d_in, C], "U": [C, d_out]}}), `load_run` (the same with the run's CI
    function; both consumer.py) and `__version__`, imported
    when asked: JAX's import, and importlib.metadata's, would cost the CLI's start-up (its
    signal handlers wait for this package's import)."""
    if name == "load_decomposition":
        from ppgd_tpu.consumer import load_decomposition

        return load_decomposition
    if name == "load_run":
        from ppgd_tpu.consumer import load_run

        return load_run
    if name != "__version__":
        raise AttributeError(f"module 'ppgd_tpu' has no attribute {name!r}")
    from importlib import metadata

    try:  # one source of truth: pyproject.toml, as installed (launch/tpu_pod.sh reads it too)
        return metadata.version("ppgd-tpu")
    except metadata.PackageNotFoundError:  # a source tree that was never installed
        return "unknown"
