"""`ppgd-tpu <command>`: dispatches to the command (COMMANDS: commands.py, or a module's
`main(argv)`), which parses its command line with the flags library (cmdline.py), and says
how it ended.

Every config field is an absl flag named by its dotted path (`--decomp.steps=2000`), typed
by the schema; `--helpfull` lists them. A refused input (unknown flag, wrong type, out of
range, inconsistent) exits with status 2 and one message naming the field, before any
compute and without touching an existing run directory. Before any command, the process is
set up for XLA:CPU (cpu_runtime.configure) and JAX's compile cache.
"""

from __future__ import annotations

import difflib
import importlib
import logging as std_logging
import os
import sys
import traceback

from absl import flags, logging

from ppgd_tpu import commands, signals, storage
from ppgd_tpu.cmdline import UsageError
from ppgd_tpu.config import ConfigError

USAGE = """usage: ppgd-tpu <command> [flags]

commands:
  train     decompose a target (no --config: the embedded TMS 5-2 default)
  eval      evaluate a run's checkpoint again (other eval settings, an earlier step)
  pretrain  train a toy target, or an LM on a token store (--store); save safetensors
  bench     benchmarks: `bench step --config ...`
  shardings print where every leaf of a run lives on the mesh (`--devices N --processes P`)
  compile   compile a run's steps for a TPU pod from any machine: memory, FLOPs, roofline
            (`--topology v4-32`; needs libtpu: pip install -e '.[tpu]')
  tokenize  pack documents into a token store
  ckpt      checkpoint tools: ls | digest | verify
  launch-local  run N local processes of a ppgd-tpu command
  sweep     train one config at many seeds and tabulate what each recovered (`--seeds 0-15`)
  report    a static site showing what each component of a run does (`--run_dir R`)

`ppgd-tpu <command> --helpfull` lists that command's flags; `ppgd-tpu --version` the
versions of ppgd-tpu and the libraries it runs on."""


# Commands implemented by other modules as `main(argv) -> int`.
DELEGATED = {
    "tokenize": "ppgd_tpu.data.tokenize",
    "ckpt": "ppgd_tpu.ckpt",
    "launch-local": "ppgd_tpu.launch_local",
    "report": "ppgd_tpu.report.command",
}
COMMANDS = {"train": commands.cmd_train, "eval": commands.cmd_eval,
            "pretrain": commands.cmd_pretrain, "bench": commands.cmd_bench,
            "shardings": commands.cmd_shardings, "compile": commands.cmd_compile,
            "sweep": commands.cmd_sweep}
# One process writes these commands' files: N processes would each write the same ones.
ONE_PROCESS = ("pretrain", "tokenize", "compile", "sweep")


def versions() -> str:
    """ppgd_tpu and the libraries a result depends on, for a bug report."""
    from importlib import metadata

    import ppgd_tpu

    libs = ("jax", "jaxlib", "equinox", "optax", "tensorstore")
    found = []
    for lib in libs:
        try:
            found.append(f"{lib} {metadata.version(lib)}")
        except metadata.PackageNotFoundError:
            found.append(f"{lib} (not installed)")
    return (f"ppgd-tpu {ppgd_tpu.__version__} (Python {sys.version.split()[0]}; "
            + ", ".join(found) + ")")


def run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        print(versions())
        return 0
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd in ONE_PROCESS:
            from ppgd_tpu import dist

            if int(os.environ.get(dist.ENV_NUM_PROCESSES) or 1) > 1:
                raise UsageError(f"{cmd} runs as one process ({dist.ENV_NUM_PROCESSES} is "
                                 f"{os.environ[dist.ENV_NUM_PROCESSES]}: every process would "
                                 "write the same files); run it without launch-local")
        if cmd in COMMANDS:
            return COMMANDS[cmd](rest)
        if cmd in DELEGATED:
            try:
                mod = importlib.import_module(DELEGATED[cmd])
            except ImportError:
                raise UsageError(f"{cmd}: not available in this build") from None
            return mod.main(rest)
        close = difflib.get_close_matches(cmd, list(COMMANDS) + list(DELEGATED), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UsageError(f"unknown command {cmd!r}{hint}\n\n{USAGE}")
    except ConfigError as e:
        return _refused(cmd, e)
    except RuntimeError as e:
        from ppgd_tpu.metrics import Diverged

        if isinstance(e, Diverged):  # every process saw the same values: each ends here
            print(f"ppgd-tpu {cmd}: error: {e}", file=sys.stderr)
            return 1
        raise
    except ValueError as e:
        from ppgd_tpu.checkpoint import DamagedCheckpoint, NewerCheckpoint
        from ppgd_tpu.targets.build import TargetError

        if isinstance(e, (TargetError, DamagedCheckpoint, NewerCheckpoint)):
            return _refused(cmd, e)
        raise


def _end(code: int, message: str) -> None:
    """Exits with `code` after `message`; in a multi-process job first tells the other
    processes (dist.report_failure), and skips the exit barrier they would never reach."""
    multi = _multi_process()
    # unless another's notice of it (the same refusal, seen at once) was said already
    if not multi or sys.modules["ppgd_tpu.dist"].claim_saying_end():
        # one write, line and newline: the failure watcher's line cannot land inside it
        sys.stderr.write(message + "\n")
        sys.stderr.flush()
    if multi:  # a traceback's last line says what failed; a refusal is all said
        notice = message if code == 2 else message.splitlines()[-1]
        # the others end with this code: 2 as refused, 130/143 as stopped, 1 as failed
        sys.modules["ppgd_tpu.dist"].report_failure(notice, code)
        os._exit(code)
    sys.exit(code)


def _multi_process() -> bool:
    dist = sys.modules.get("ppgd_tpu.dist")  # None: single-process, or JAX failed to import
    return dist is not None and dist.process_count() > 1


def _refused(cmd: str, e: Exception) -> int:
    """Exit status 2 for a refused input, said in one line. In a multi-process job the
    others are told (they end with 2 too): a refusal that one process alone saw would leave
    them waiting for it in their next collective."""
    message = f"ppgd-tpu {cmd}: error: {e}"
    if _multi_process():
        _end(2, message)
    print(message, file=sys.stderr)
    return 2


def _interrupted() -> None:
    """Ends a command that a signal stopped before a run's loop (which stops cleanly on
    one itself [C5])."""
    name = signals.seen[0]
    said = "terminated" if name == "SIGTERM" else "interrupted"
    _end(143 if name == "SIGTERM" else 130, f"ppgd-tpu: {said} ({name}); {commands.again}")


def _setup() -> None:
    from ppgd_tpu import cache, cpu_runtime

    cpu_runtime.configure()  # before JAX is imported: it reads JAX_PLATFORMS then
    cpu_runtime.keep_step_buffers()
    cache.enable_compile_cache()  # imports JAX
    flags.FLAGS.mark_as_parsed()  # ours parse per command; absl's own need only defaults
    logging.set_verbosity(logging.INFO)
    logging.use_absl_handler()
    # gcsfs logs a traceback when it gives up on a request; the error it then raises ends
    # the command with one line naming the path (storage.Unreachable)
    std_logging.getLogger("gcsfs").setLevel(std_logging.CRITICAL)
    if cpu_runtime.computes_on_cpu():  # no accelerator plugin: JAX's TPU probe must fail
        std_logging.getLogger("jax._src.xla_bridge").setLevel(std_logging.WARNING)


def _unreachable(e: BaseException | None) -> BaseException | None:
    """The storage.Unreachable that `e` is or was raised from (a background save's)."""
    while e is not None and not isinstance(e, storage.Unreachable):
        e = e.__cause__ or e.__context__
    return e


def main() -> None:
    signals.install()  # again: `python -m ppgd_tpu.cli` does not go through __main__
    signals.follow_launcher()
    try:
        _setup()
        code = run(sys.argv[1:])
    except (KeyboardInterrupt, signals.Terminated):
        _interrupted()
    except BrokenPipeError:  # `ppgd-tpu train --helpfull | head`: the reader is gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no flush error
        sys.exit(141)  # as if killed by SIGPIPE
    except Exception as e:
        if signals.seen:  # the signal's raise, turned into another error (an import's)
            _interrupted()
        cause = _unreachable(e)
        if cause is not None:  # the path and the cause say it all
            _end(1, f"ppgd-tpu: failed: {e}: {cause}; {commands.again}" if cause is not e
                 else f"ppgd-tpu: failed: {e}; {commands.again}")
        _end(1, f"{traceback.format_exc()}ppgd-tpu: failed: {type(e).__name__}: {e}")
    sys.exit(code)


if __name__ == "__main__":
    main()
