"""The `ppgd-tpu` compile cache (ppgd_tpu/cache.py): a second run of a config loads every
program from it instead of compiling, with the same results; off and user settings win."""

import json
import os
import subprocess
import sys
import threading
import time

import filelock

from ppgd_tpu import cache

ARGS = ["--decomp.steps=20", "--data.batch_size=64", "--eval.batch_size=128", "--eval.every=10",
        "--log.every=10", "--log.progress=false", "--eval.pgd_steps=2"]


def _env(**extra):
    """This session's env without its own JAX cache settings (conftest), plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    return {**env, "JAX_PLATFORMS": "cpu", **extra}


def _entries(path):
    return sorted(f for f in os.listdir(path) if f.endswith("-cache")) if os.path.isdir(path) else []


def _losses(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as fh:
        rows = [json.loads(line) for line in fh]
    return [(r["step"], r["train/loss/total"]) for r in rows if "train/loss/total" in r]


def test_second_run_loads_every_program_from_the_cache_with_the_same_results(tmp_path):
    from ppgd_tpu.config import Config
    from ppgd_tpu.targets import build

    build.build(Config().target)  # both runs load the default target (none trains it)
    root = tmp_path / "root"
    env = _env(PPGD_TPU_CACHE=os.environ["PPGD_TPU_CACHE"])  # the session's trained targets
    xla = os.path.join(cache.root(env), "xla", cache.machine_fingerprint())
    before = _entries(xla)
    runs = []
    for name in ("cold", "warm"):
        run_dir = root / name
        p = subprocess.run([sys.executable, "-m", "ppgd_tpu.cli", "train", f"--run_dir={run_dir}",
                            *ARGS], env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append((_entries(xla), _losses(run_dir)))
    (cold, cold_losses), (warm, warm_losses) = runs
    assert len(cold) > len(before) + 5  # the step, the evals, the data: each compiled once
    assert warm == cold  # nothing compiled the second time
    assert len(cold_losses) >= 2 and warm_losses == cold_losses

    # A writer killed mid-entry leaves it empty and without its -atime file: the next run
    # drops it and compiles that program again, instead of failing to load it every run.
    torn = sorted(set(cold) - set(before))[0]
    open(os.path.join(xla, torn), "wb").close()
    os.remove(os.path.join(xla, torn[:-len("cache")] + "atime"))
    run_dir = root / "after_a_torn_entry"
    p = subprocess.run([sys.executable, "-m", "ppgd_tpu.cli", "train", f"--run_dir={run_dir}",
                        *ARGS], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Error reading persistent compilation cache entry" not in p.stderr
    assert os.path.getsize(os.path.join(xla, torn)) > 0  # written again, whole
    assert _entries(xla) == cold and _losses(run_dir) == cold_losses


_SETTINGS = """
import json, jax
from ppgd_tpu import cache
base = {"PPGD_TPU_CACHE": "/r"}
out = {}
for name, env in [("default", base), ("path", {**base, "PPGD_TPU_COMPILE_CACHE": "/elsewhere"}),
                  ("off", {**base, "PPGD_TPU_COMPILE_CACHE": "off"}),
                  ("jax_env", {**base, "JAX_COMPILATION_CACHE_DIR": "/users"})]:
    jax.config.update("jax_compilation_cache_dir", None)
    got = cache.enable_compile_cache(env)
    out[name] = [got, jax.config.jax_compilation_cache_dir]
jax.config.update("jax_compilation_cache_dir", "/set_in_python")
out["jax_config"] = [cache.enable_compile_cache(base), jax.config.jax_compilation_cache_dir]
print(json.dumps(out))
"""


def test_cache_location_off_switch_and_the_users_own_jax_cache_win():
    p = subprocess.run([sys.executable, "-c", _SETTINGS], env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    default = f"/r/xla/{cache.machine_fingerprint()}"
    assert out["default"] == [default, default]
    assert out["path"] == ["/elsewhere", "/elsewhere"]
    assert out["off"] == [None, None]
    assert out["jax_env"] == ["/users", None]  # JAX reads its env var itself
    assert out["jax_config"] == ["/set_in_python", "/set_in_python"]


def test_an_entry_another_command_is_writing_is_not_dropped_as_torn(tmp_path):
    """JAX writes `<key>-cache`, then `<key>-atime`, under its lock of the cache dir; a
    command starting meanwhile must wait for the lock, not drop the half-written entry."""
    (tmp_path / "k0-cache").write_bytes(b"")  # a killed writer left this one
    between = threading.Event()

    def write_entry():
        with filelock.FileLock(str(tmp_path / cache.LOCK_FILE)):
            (tmp_path / "k1-cache").write_bytes(b"program")
            between.set()  # the writer is between its two files
            time.sleep(0.5)
            (tmp_path / "k1-atime").write_bytes(b"12345678")

    writer = threading.Thread(target=write_entry)
    writer.start()
    assert between.wait(10)
    assert cache.drop_torn_entries(str(tmp_path)) == ["k0-cache"]
    writer.join()
    assert sorted(os.listdir(tmp_path)) == [cache.LOCK_FILE, "k1-atime", "k1-cache"]
