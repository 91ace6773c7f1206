"""ppgd_tpu: rank-1 parameter decomposition of frozen networks (SPEC.md).

Importing it changes nothing in the process. The `ppgd-tpu` entry point sets the process up
for XLA:CPU (cpu_runtime.py); a Python user who wants the programs a `ppgd-tpu` command
compiles (results bitwise comparable with its runs [C3]) calls `configure_cpu()` first,
before JAX is imported.
"""

__all__ = ["configure_cpu", "load_decomposition", "load_run"]


def configure_cpu() -> None:
    """What the `ppgd-tpu` entry point does before JAX starts (cpu_runtime.configure): with
    libtpu installed but no TPU attached, JAX_PLATFORMS=cpu (no TPU probe); when JAX
    computes on CPU, the XLA:CPU flags of cpu_runtime.XLA_CPU_FLAGS. Settings the user made
    (JAX_PLATFORMS, the flags in XLA_FLAGS) win. Call it before importing JAX: JAX reads
    both when it is imported / creates its backends (a warning says when it was too late)."""
    from ppgd_tpu import cpu_runtime

    cpu_runtime.configure()


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
