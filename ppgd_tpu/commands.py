"""The commands that `ppgd-tpu` (cli.py) dispatches to and that have no module of their own:
`main(argv) -> int` each, argv without the program and command names. A refused command line
raises cmdline.UsageError (exit 2); `--helpfull` prints the command's flags."""

from __future__ import annotations

import os

from ppgd_tpu import cmdline, storage
from ppgd_tpu import config as config_lib
from ppgd_tpu.cmdline import HELP, UsageError, count, optional, parse_config_args, split_value

AGAIN = "nothing partial is read as complete: re-run the same command to start or resume"
again = AGAIN  # what re-running means: with the run dir a `train` without --run_dir chose


def cmd_train(args: list[str]) -> int:
    from ppgd_tpu import dist

    cfg, extra = parse_config_args(args, {"run_dir": ("", "run directory (default: "
                                                      "runs/<name>-<timestamp>)")})
    dist.initialize()  # before any JAX computation; single-process unless PPGD_* / TPU say so
    from ppgd_tpu import engine
    from ppgd_tpu.workspace import default_run_dir

    global again
    run_dir = dist.broadcast_from_main(extra["run_dir"] or default_run_dir(cfg))
    if not extra["run_dir"]:  # the same command again would choose a new dir
        again = f"{AGAIN} with --run_dir={run_dir}"
    engine.train(cfg, run_dir)
    return 0


def cmd_eval(args: list[str]) -> int:
    """Evaluates a committed checkpoint of a run with the run's config, in which only the
    fields of config.EVAL_FIELDS may be given (engine.evaluate_checkpoint)."""
    from ppgd_tpu import dist
    from ppgd_tpu.workspace import RunDir

    helping = any(a in HELP for a in args)
    if split_value(args, "config") is not None and not helping:
        raise UsageError("--config: eval reads the run's own config (RUN_DIR/config.yaml); "
                         "leave --config out and give --run_dir")
    run_dir = split_value(args, "run_dir")
    rd = RunDir(run_dir) if run_dir else None
    if rd is None and not helping:
        raise UsageError("--run_dir: which run to evaluate? e.g. --run_dir runs/tms52")
    if rd is not None and not rd.exists:
        raise UsageError(f"--run_dir: {rd.path} holds no run (no config.yaml)")
    base = rd.stored_config() if rd is not None else config_lib.Config()
    cfg, extra = parse_config_args(args, {
        "run_dir": ("", "the run to evaluate"),
        "step": ("", "a committed checkpoint's step (default: the latest)",
                 optional(count)),
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

    base = config_lib.read(split_value(args, "config"))
    kind = split_value(args, "target.kind") or base.target.kind
    if kind == "llama_simple_mlp":
        return cmd_pretrain_lm(args)  # an LM trains on a token store (--store)
    if split_value(args, "store") is not None:
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


def cmd_pretrain_lm(argv: list[str]) -> int:
    """`ppgd-tpu pretrain --config C --store STORE [--output PATH] [--<field>=V ...]` for an
    LM target (targets/lm_pretrain.py)."""
    from ppgd_tpu import lockfile
    from ppgd_tpu import metrics as metrics_lib
    from ppgd_tpu.targets.lm_pretrain import lock_path, metrics_path, pretrain_lm, resume_path

    cfg, extra = parse_config_args(argv, {
        "store": ("", "token store (from `ppgd-tpu tokenize`) to train the LM on"),
        "output": TARGET_OUTPUT})
    if not extra["store"]:
        raise UsageError("--store: required for an LM target (a token store made by "
                         "`ppgd-tpu tokenize`)")
    out = target_output(cfg, extra["output"])
    for side in (metrics_path(out), resume_path(out), lock_path(out)):  # beside it: checked alike
        try:
            storage.check_creatable(side, directory=False)
        except ValueError as e:
            raise UsageError(f"--output: {out} needs {side} beside it, but {e}") from None

    def in_use(holder):
        return UsageError(
            f"--output: {out} is being written by another `ppgd-tpu pretrain` ({holder}, per "
            f"{lock_path(out)}); two would interleave its log and resume state. Wait for it "
            "to end, or stop it (SIGTERM saves its resume state) and re-run this command to "
            "resume, or give another --output")

    with lockfile.holding(lock_path(out), in_use):
        summary = pretrain_lm(cfg.target, extra["store"], out, progress=cfg.log.progress)
    if summary is None:
        return 0
    print(metrics_lib.table({k: v for k, v in summary.items() if k != "step"}))
    print(f"saved the {cfg.target.kind} target to {out} (metrics: {metrics_path(out)}); use it "
          f"with --target.path={out}")
    return 0


TARGET_OUTPUT = ("", "safetensors path, local or gs:// "
                     "(default: runs/targets/<kind>-<seed>.safetensors)")


def target_output(cfg, value: str) -> str:
    """`pretrain --output` (TARGET_OUTPUT) or its default; refused before any training if
    it could not be written."""
    out = cmdline.output_path("output", value or os.path.join(
        "runs", "targets", f"{cfg.target.kind}-{cfg.target.seed}.safetensors"), directory=False)
    from ppgd_tpu.targets import build

    if storage.exists(out) and build.recorded(build.header(out) or b"", "target") is None:
        raise UsageError(f"--output: {out} exists and is not a target `pretrain` wrote (its "
                         "weights would replace it): give another path, or move it away")
    return out


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
    from ppgd_tpu.programs import run_templates
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
        named, _ = run_templates(dec, target, batch,
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
