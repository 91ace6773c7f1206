"""The entry point's XLA:CPU settings (ppgd_tpu/cpu_runtime.py): added, never overriding;
made by the `ppgd-tpu` entry point or `ppgd_tpu.configure_cpu()`, never by an import."""

import os
import subprocess
import sys

import pytest

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


def test_importing_ppgd_tpu_sets_nothing_and_configure_cpu_warns_when_too_late():
    """No import side effects: the settings come from the entry point, or from an explicit
    `ppgd_tpu.configure_cpu()` before JAX starts (the Python API then compiles the CLI's
    programs [C3]); called after JAX created its backends it says they were not applied."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = lambda code: subprocess.run([sys.executable, "-W", "always", "-c", code], env=env,
                                      capture_output=True, text=True, check=True)
    p = run("import ppgd_tpu, os; print(os.environ.get('XLA_FLAGS', '<unset>'))")
    assert p.stdout.split() == ["<unset>"]
    p = run("import ppgd_tpu, os; ppgd_tpu.configure_cpu(); print(os.environ['XLA_FLAGS'])")
    assert p.stdout.split() == list(cpu_runtime.XLA_CPU_FLAGS) and "not applied" not in p.stderr
    p = run("import jax; jax.numpy.zeros(1).block_until_ready(); import ppgd_tpu; "
            "ppgd_tpu.configure_cpu()")
    assert "not applied" in p.stderr


def test_plugins_and_tpu_device_nodes_decide_where_jax_computes(tmp_path, monkeypatch):
    """No plugin, or libtpu without a TPU attached (the `tpu` extra on a CPU host): CPU, and
    JAX is told so (no TPU probe); a TPU host or a GPU plugin: not; JAX_PLATFORMS wins."""
    node = tmp_path / "accel0"
    monkeypatch.setattr(cpu_runtime, "TPU_DEVICE_NODES", (str(tmp_path / "accel*"),))
    monkeypatch.setattr(cpu_runtime, "_plugins", lambda: ["libtpu"])
    env = {}
    cpu_runtime.skip_tpu_probe(env)
    assert cpu_runtime.computes_on_cpu({}) and env == {"JAX_PLATFORMS": "cpu"}
    mine = {"JAX_PLATFORMS": "tpu"}
    cpu_runtime.skip_tpu_probe(mine)
    assert mine == {"JAX_PLATFORMS": "tpu"}
    node.touch()  # a TPU host
    env = {}
    cpu_runtime.skip_tpu_probe(env)
    assert not cpu_runtime.computes_on_cpu({}) and env == {}
    assert cpu_runtime.computes_on_cpu({"JAX_PLATFORMS": "cpu"})
    node.unlink()
    monkeypatch.setattr(cpu_runtime, "_plugins", lambda: ["libtpu", "jax_cuda12_plugin"])
    assert not cpu_runtime.computes_on_cpu({})
    monkeypatch.setattr(cpu_runtime, "_plugins", lambda: [])
    assert cpu_runtime.computes_on_cpu({})


@pytest.mark.parametrize("setup", ["from ppgd_tpu import cli; cli._setup()",  # ppgd-tpu
                                   "import ppgd_tpu; ppgd_tpu.configure_cpu()"])  # the API
def test_libtpu_on_a_host_without_a_tpu_computes_on_cpu_with_the_cpu_flags(tmp_path, setup):
    """The `tpu` extra installed here must not change training: JAX is not sent probing
    for a TPU (no libtpu errors), and the programs get the same XLA:CPU flags, whether a
    `ppgd-tpu` command (cli.main's setup, before anything imports JAX) or a Python user's
    explicit call set the process up."""
    (tmp_path / "libtpu").mkdir()  # importable, as the real one is where the extra is
    (tmp_path / "libtpu" / "__init__.py").write_text("")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    code = (f"{setup}; import os, jax; print(os.environ['JAX_PLATFORMS'], "
            "jax.devices()[0].platform, os.environ['XLA_FLAGS'])")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True)
    assert p.stdout.split() == ["cpu", "cpu", *cpu_runtime.XLA_CPU_FLAGS]
    assert "TPU" not in p.stderr and "libtpu" not in p.stderr, p.stderr
