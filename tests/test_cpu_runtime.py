"""The entry point's XLA:CPU settings (ppgd_tpu/cpu_runtime.py): added, never overriding."""

import os
import subprocess
import sys

from ppgd_tpu import cpu_runtime


def test_xla_cpu_flags_are_appended_and_user_flags_win():
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    cpu_runtime.add_xla_cpu_flags(env)
    assert env["XLA_FLAGS"].split() == ["--xla_force_host_platform_device_count=4",
                                        *cpu_runtime.XLA_CPU_FLAGS]
    mine = {"XLA_FLAGS": f"{cpu_runtime.YNN_FLAG}=+reduce", "JAX_PLATFORMS": "cpu"}
    cpu_runtime.add_xla_cpu_flags(mine)
    assert mine["XLA_FLAGS"] == f"{cpu_runtime.YNN_FLAG}=+reduce"
    empty = {"JAX_PLATFORMS": "cpu"}
    cpu_runtime.add_xla_cpu_flags(empty)
    assert empty["XLA_FLAGS"] == " ".join(cpu_runtime.XLA_CPU_FLAGS)


def test_malloc_thresholds_are_set_unless_the_user_set_malloc_variables():
    code = "from ppgd_tpu import cpu_runtime; print(cpu_runtime.keep_step_buffers())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    run = lambda e: subprocess.run([sys.executable, "-c", code], env=e, capture_output=True,
                                   text=True, check=True).stdout.strip()
    assert run(env) == "True"  # glibc (this machine, TPU VMs)
    assert run({**env, "MALLOC_ARENA_MAX": "2"}) == "False"


def test_importing_ppgd_tpu_sets_the_xla_flags_before_jax_starts_and_warns_after():
    """The CLI, the Python API and tests must compile the same programs [C3]."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = lambda code: subprocess.run([sys.executable, "-W", "always", "-c", code], env=env,
                                      capture_output=True, text=True, check=True)
    p = run("import ppgd_tpu, os; print(os.environ['XLA_FLAGS'])")
    assert p.stdout.split() == list(cpu_runtime.XLA_CPU_FLAGS) and "not applied" not in p.stderr
    p = run("import jax; jax.numpy.zeros(1).block_until_ready(); import ppgd_tpu")
    assert "not applied" in p.stderr


def test_no_xla_cpu_flags_where_an_accelerator_plugin_is_installed(tmp_path):
    """A TPU host (libtpu importable, JAX_PLATFORMS unset) gets no CPU flags; asking for the
    CPU platform there still gets them."""
    (tmp_path / "libtpu").mkdir()
    (tmp_path / "libtpu" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    code = "import ppgd_tpu, os; print(os.environ.get('XLA_FLAGS', '-'))"
    run = lambda e: subprocess.run([sys.executable, "-c", code], env=e, capture_output=True,
                                   text=True, check=True).stdout.strip()
    assert run(env) == "-"
    assert run({**env, "JAX_PLATFORMS": "cpu"}) == " ".join(cpu_runtime.XLA_CPU_FLAGS)
