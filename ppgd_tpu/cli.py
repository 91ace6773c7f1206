"""`ppgd-tpu <command>`: train, eval, pretrain, bench, shardings (and the commands other
modules provide).

Every config field is an absl flag named by its dotted path (`--decomp.steps=2000`), typed
by the schema; `--helpfull` lists them. A refused input (unknown flag, wrong type, out of
range, inconsistent) exits with status 2 and one message naming the field, before any
compute and without touching an existing run directory.
"""

from __future__ import annotations

import difflib
import importlib
import logging as std_logging
import os
import re
import sys
import traceback
import typing
from typing import Literal

from absl import flags, logging

from ppgd_tpu import config as config_lib
from ppgd_tpu import signals, storage
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

`ppgd-tpu <command> --helpfull` lists that command's flags; `ppgd-tpu --version` the
versions of ppgd-tpu and the libraries it runs on."""


HELP = ("--helpfull", "--help", "-h")


class UsageError(ConfigError):
    """A bad command line (exit 2)."""


def _split_value(args: list[str], name: str) -> str | None:
    """The value of --name in args (either --name=V or --name V), without parsing the rest;
    the last one if repeated, as absl takes every other flag's."""
    value = None
    for i, a in enumerate(args):
        if a == f"--{name}" and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(f"--{name}="):
            value = a.split("=", 1)[1]
    return value


def _named(args: list[str]) -> dict[str, str | None]:
    """{name: value text} of every `--name=V` / `--name V` in args (V None if absent)."""
    out = {}
    for a in args:
        if a.startswith("--"):
            name = a[2:].split("=", 1)[0]
            out[name] = _split_value(args, name)
    return out


def join_values(args: list[str], names) -> list[str]:
    """`--name value` -> `--name=value` for these (string) flags, as absl expects."""
    out, i = [], 0
    while i < len(args):
        if args[i] in {f"--{n}" for n in names} and i + 1 < len(args):
            out.append(f"{args[i]}={args[i + 1]}")
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


def _define(fv: flags.FlagValues, path: str, tp, default, help_: str) -> None:
    kw = dict(flag_values=fv, help=f"{help_} (default {default!r})")
    if typing.get_origin(tp) is Literal:
        flags.DEFINE_enum(path, None, [str(a) for a in typing.get_args(tp)], **kw)
    elif tp is bool:
        flags.DEFINE_boolean(path, None, **kw)
    else:  # numbers too: typed by config._coerce, as a YAML value is (`--decomp.steps=2e4`)
        flags.DEFINE_string(path, None, **kw)


def count(text: str) -> int:
    """A command flag's value that counts something: a whole number >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError("use a whole number >= 1")
    return int(text)


def counts(text: str) -> list[int]:
    """Comma-separated counts (`1,4`); empty: none."""
    try:
        return [count(c) for c in text.split(",")] if text else []
    except ValueError:
        raise ValueError("use comma-separated whole numbers >= 1, e.g. 1,4") from None


def choice(*options: str):
    """A command flag's value from a fixed set."""
    def parse(text: str) -> str:
        if text not in options:
            raise ValueError(f"use one of {', '.join(options)}")
        return text
    return parse


def _bad_value(message: str, leaves: dict) -> str:
    """absl's "flag --PATH=VALUE: <parser's words>" in the words a bad YAML value gets."""
    m = re.match(r"flag --([^=]+)=(.*?): ", message, re.S)
    if not m or m.group(1) not in leaves:
        return message
    return str(config_lib.not_a(m.group(1), m.group(2), leaves[m.group(1)]))


def parse_config_args(args: list[str], extra: dict[str, tuple] | None = None,
                      base: config_lib.Config | None = None, shown: tuple[str, ...] = ("",)):
    """Parses `[--config PATH] [--<dotted.field>=V ...] [extra flags]` -> (Config, extras).
    With `base` (a run's config), the fields start from it and --config is not a flag;
    --helpfull lists the fields whose path starts with one of `shown`.

    `extra` maps a command's own flag names to (default, help) or (default, help, parse):
    `parse` (e.g. `count`, `choice(...)`) turns the string into its value or raises
    ValueError saying what is valid, which exits 2 naming the flag. The YAML file is loaded
    first so its dict entries (recon terms, site patterns) get flags too, as do the new
    entries a flag names (`--decomp.tie.linear2=linear1`, config.with_entries).
    """
    extra = dict(extra or {})
    args = join_values(args, ["config", *extra] if base is None else list(extra))
    path = _split_value(args, "config") if base is None else None
    cfg = config_lib.with_entries(base or config_lib.read(path), _named(args))
    fv = flags.FlagValues()
    if base is None:
        flags.DEFINE_string("config", None, "experiment YAML (none: the embedded default)",
                            flag_values=fv)
    for name, (default, help_, *_) in extra.items():
        flags.DEFINE_string(name, default, help_, flag_values=fv)
    leaves = {p: tp for p, tp, _, _ in config_lib.leaves(cfg)}
    for p, tp, value, help_ in config_lib.leaves(cfg):
        _define(fv, p, tp, value, help_)
    if any(a in HELP for a in args):
        if base is None:
            print(f"flags (with --config {path or '<embedded default>'}):")
            print("  --config=PATH  experiment YAML")
        else:
            print("flags (a field's default is its value in RUN_DIR/config.yaml):")
        for name, (default, help_, *_) in extra.items():
            print(f"  --{name}={default}  {help_}")
        print(config_lib.describe(cfg, shown))
        raise SystemExit(0)
    try:
        positional = fv(["ppgd-tpu", *args])[1:]
    except flags.UnrecognizedFlagError as e:
        close = difflib.get_close_matches(e.flagname, list(leaves) + list(extra), n=3)
        hint = f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""
        raise UsageError(f"--{e.flagname}: unknown flag{hint} (see --helpfull)") from None
    except flags.IllegalFlagValueError as e:
        raise UsageError(_bad_value(str(e), leaves)) from None
    except flags.Error as e:
        raise UsageError(str(e)) from None
    if positional:
        raise UsageError(f"unexpected arguments {positional}; flags look like --decomp.steps=100")
    overrides = {p: fv[p].value for p in leaves if fv[p].present}
    cfg = config_lib.with_overrides(cfg, overrides)
    values = {}
    for name, (_, _, *parse) in extra.items():
        text = fv[name].value
        try:
            values[name] = parse[0](text) if parse else text
        except ValueError as e:
            raise UsageError(f"--{name}={text!r}: {e}") from None
    return cfg, values


TARGET_OUTPUT = ("", "safetensors path, local or gs:// "
                     "(default: runs/targets/<kind>-<seed>.safetensors)")


def target_output(cfg, value: str) -> str:
    """`pretrain --output` (TARGET_OUTPUT) or its default; refused before any training if
    it could not be written."""
    out = value or os.path.join("runs", "targets",
                                f"{cfg.target.kind}-{cfg.target.seed}.safetensors")
    try:
        storage.check_creatable(out, directory=False)
    except ValueError as e:
        raise UsageError(f"--output: {e}") from None
    from ppgd_tpu.targets import build

    if storage.exists(out) and build.recorded(build.header(out) or b"", "target") is None:
        raise UsageError(f"--output: {out} exists and is not a target `pretrain` wrote (its "
                         "weights would replace it): give another path, or move it away")
    return out


# ---------------------------------------------------------------- commands


def cmd_train(args: list[str]) -> int:
    from ppgd_tpu import dist

    cfg, extra = parse_config_args(args, {"run_dir": ("", "run directory (default: "
                                                      "runs/<name>-<timestamp>)")})
    dist.initialize()  # before any JAX computation; single-process unless PPGD_* / TPU say so
    from ppgd_tpu import engine
    from ppgd_tpu.workspace import default_run_dir

    global _again
    run_dir = dist.broadcast_from_main(extra["run_dir"] or default_run_dir(cfg))
    if not extra["run_dir"]:  # the same command again would choose a new dir
        _again = f"{AGAIN} with --run_dir={run_dir}"
    engine.train(cfg, run_dir)
    return 0


def cmd_eval(args: list[str]) -> int:
    """Evaluates a committed checkpoint of a run with the run's config, in which only the
    fields of config.EVAL_FIELDS may be given (engine.evaluate_checkpoint)."""
    from ppgd_tpu import dist
    from ppgd_tpu.workspace import RunDir

    helping = any(a in HELP for a in args)
    if _split_value(args, "config") is not None and not helping:
        raise UsageError("--config: eval reads the run's own config (RUN_DIR/config.yaml); "
                         "leave --config out and give --run_dir")
    run_dir = _split_value(args, "run_dir")
    rd = RunDir(run_dir) if run_dir else None
    if rd is None and not helping:
        raise UsageError("--run_dir: which run to evaluate? e.g. --run_dir runs/tms52")
    if rd is not None and not rd.exists:
        raise UsageError(f"--run_dir: {rd.path} holds no run (no config.yaml)")
    base = rd.stored_config() if rd is not None else config_lib.Config()
    cfg, extra = parse_config_args(args, {
        "run_dir": ("", "the run to evaluate"),
        "step": ("", "a committed checkpoint's step (default: the latest)",
                 lambda t: count(t) if t else None),
        "output": ("", "where summary.json, config.yaml and figures/ go, local or gs:// "
                   "(default: RUN_DIR/evals/step_<step>)")},
        base=base, shown=config_lib.EVAL_FIELDS)
    fixed = list(config_lib.changed_fields(base, cfg, config_lib.EVAL_FIELDS))
    if fixed:
        fields = [f + "*" if f.endswith(".") else f for f in config_lib.EVAL_FIELDS]
        raise UsageError(f"--{fixed[0]}: eval keeps the run's config; the fields it may be "
                         f"given are {', '.join(fields)} (see --helpfull)")
    dist.initialize()
    from ppgd_tpu import engine

    engine.evaluate_checkpoint(cfg, rd, extra["step"], extra["output"] or None)
    return 0


def cmd_pretrain(args: list[str]) -> int:
    from ppgd_tpu.targets import build

    base = config_lib.read(_split_value(args, "config"))
    kind = _split_value(args, "target.kind") or base.target.kind
    if kind == "llama_simple_mlp":
        from ppgd_tpu.targets import lm_pretrain

        return lm_pretrain.main(args)  # an LM trains on a token store (--store)
    if _split_value(args, "store") is not None:
        raise UsageError(f"--store: only an LM target trains on a token store; this config's "
                         f"target is {kind!r}, which trains without one. Give an "
                         "LM config, e.g. --config configs/lm_demo_2L.yaml")

    cfg, extra = parse_config_args(args, {"output": TARGET_OUTPUT})
    out = target_output(cfg, extra["output"])
    if build.already_pretrained(out, cfg.target):
        return 0
    target = build.pretrain(cfg.target)
    build.check(target, cfg.target)
    build.save(target, cfg.target, out)
    print(f"saved the {cfg.target.kind} target to {out}; use it with --target.path={out}")
    return 0


def cmd_bench(args: list[str]) -> int:
    from ppgd_tpu import bench

    if args and args[0] in HELP:
        print("usage: ppgd-tpu bench <case> [--config ...] [flags]; `ppgd-tpu bench <case> "
              f"--helpfull` lists a case's flags.\n\n{bench.__doc__}")
        return 0
    if not args or args[0].startswith("-"):
        raise UsageError(f"bench: which benchmark? one of {', '.join(bench.CASES)}")
    return bench.main(args[0], args[1:])


def cmd_shardings(args: list[str]) -> int:
    """The placement table of a config on a mesh of N devices over P processes/slices
    (default: this machine's), from shapes alone: no weights are loaded or trained."""
    import jax

    from ppgd_tpu import mesh as mesh_lib
    from ppgd_tpu import replay
    from ppgd_tpu.data import lm as data_lib
    from ppgd_tpu.step import Decomposer
    from ppgd_tpu.targets import build

    cfg, extra = parse_config_args(args, {
        "devices": ("", "global device count (default: this machine's)",
                    lambda t: count(t) if t else jax.device_count()),
        "processes": ("1", "slices/processes the devices split into (DCN granules)", count)})
    n_dev = extra["devices"]
    mesh = mesh_lib.abstract_mesh(cfg.mesh, n_dev, extra["processes"])
    mesh_lib.check_batches(cfg, mesh)
    mod, sub = build.KINDS[cfg.target.kind], getattr(cfg.target, cfg.target.kind)
    rows = []

    def trace():  # under eval_shape: shapes only, nothing is computed
        target = mod.init(sub, jax.random.key(0))
        dec = Decomposer(cfg, target, data_lib.batch_shape(cfg, target))
        batch = jax.ShapeDtypeStruct(data_lib.batch_shape(cfg, target),
                                     data_lib.batch_dtype(target))
        held = replay.POLICIES[cfg.data.replay_ci_update].held(dec.envelope_reads_V)
        named, _ = mesh_lib.run_templates(dec, target, batch,
                                          replay.window_template(dec, target, batch, held))
        placement = mesh_lib.Placement(cfg, mesh, len(dec.leading))
        for leaves in named.values():
            rows.extend(placement.rows(leaves))

    jax.eval_shape(trace)
    print(f"mesh {dict(mesh.shape)} over {n_dev} devices, {extra['processes']} process(es)")
    print(mesh_lib.table(rows))
    return 0


def cmd_compile(args: list[str]) -> int:
    # compile-only: the topology's devices come from libtpu's compiler; JAX itself computes
    # nothing, so on a TPU VM it must not take the chips (a training job may hold them)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from ppgd_tpu import aot

    return aot.main(args)


def cmd_sweep(args: list[str]) -> int:
    from ppgd_tpu import sweep

    return sweep.main(args)


# Commands implemented by other modules as `main(argv) -> int`.
DELEGATED = {
    "tokenize": "ppgd_tpu.data.tokenize",
    "ckpt": "ppgd_tpu.checkpoint.cli",
    "launch-local": "ppgd_tpu.launch_local",
}
COMMANDS = {"train": cmd_train, "eval": cmd_eval, "pretrain": cmd_pretrain, "bench": cmd_bench,
            "shardings": cmd_shardings, "compile": cmd_compile, "sweep": cmd_sweep}
# One process writes these commands' files: N processes would each write the same ones.
ONE_PROCESS = ("pretrain", "tokenize", "compile", "sweep")


def _argparse_help(args: list[str]) -> list[str]:
    """`--helpfull` as argparse spells it, up to a `--` (what follows is another command's)."""
    end = args.index("--") if "--" in args else len(args)
    return [("--help" if a == "--helpfull" else a) for a in args[:end]] + args[end:]


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
            return mod.main(_argparse_help(rest))
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


AGAIN = "nothing partial is read as complete: re-run the same command to start or resume"
_again = AGAIN  # with the run dir a `train` without --run_dir chose (cmd_train)


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
    _end(143 if name == "SIGTERM" else 130,
         f"ppgd-tpu: {'terminated' if name == 'SIGTERM' else 'interrupted'} ({name}); {_again}")


def _setup() -> None:
    from ppgd_tpu import cache, cpu_runtime

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
            _end(1, f"ppgd-tpu: failed: {e}: {cause}; {_again}" if cause is not e
                 else f"ppgd-tpu: failed: {e}; {_again}")
        _end(1, f"{traceback.format_exc()}ppgd-tpu: failed: {type(e).__name__}: {e}")
    sys.exit(code)


if __name__ == "__main__":
    main()
