"""`ppgd-tpu bench <case>`: measurements that are ratios or distributions taken in ONE run.

- `step`: compile time (and whether the persistent compile cache loaded the step), the
  steady-state step time (median of individually timed steps), the loop's step time (steps
  dispatched back to back, as the engine runs them), device-only step time (the same
  steps inside one jitted fori_loop), host overhead share = 1 - device_only / loop,
  steps/s and peak RSS; the compiled step's FLOPs (`xla_gflop`, XLA's count, which counts a
  scanned block once; `matmul_gflop`, its matmuls with loops counted by their trip counts)
  and the rate the median step runs its matmuls at (`achieved_gflop_per_s`; a live-rows step
  counts both branches, so its rate reads high), beside a 2048^3 fp32 matmul's rate
  measured in the same process (`matmul_2048_gflop_per_s`); where the step runs its recon on
  the live rows only
  (decomp/live_rows.py), that step vs the same step on every row, paired;
  with persistent-PGD terms, the step vs the same step without them, paired (without a
  live-rows switch also the matmul FLOPs of each, and the rate the terms' added FLOPs run
  at next to a 2048^3 matmul's).
  With `--devices 1,4` it instead runs itself once per device count (forced CPU devices in
  a subprocess) and compares the per-device memory of the placed train state: sharded
  leaves shrink with the device count, replicated ones do not. `--timing=false` reports
  the state memory alone (no step is compiled or timed). `--profile=N` also lists the N
  XLA ops the step spends the most time in (a jax.profiler trace of n_steps steps).
- `run`: wall time of a whole `ppgd-tpu train` (startup, target, warmup, evals, figures) in
  a subprocess, plus its peak RSS; a first run (empty compile cache) or a repeat run.
- `replay`: the full step vs the repeat step (their ratio), and the per-step time of whole
  replay windows in each CI-update mode relative to `every`, the modes' windows interleaved
  round-robin (ratios paired in time), with `first`'s ideal window ratio beside it.
- `ckpt`: per checkpoint, the time the loop blocks, the background write + commit time, the
  bytes written, and how many of them are replay-window state.
- `step` also splits the step between the CI fn and the rest (any target): the full
  step vs the repeat step (no taps, no CI fn forward/backward [W3]) and their difference.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import gzip
import json
import os
import pathlib
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ppgd_tpu import cmdline, hlo, storage, workspace


def _peak_rss_mb(who=resource.RUSAGE_SELF) -> float:
    return resource.getrusage(who).ru_maxrss / 1024.0  # Linux reports KiB


def state_bytes_per_device(state) -> tuple[int, int]:
    """(max over devices, total) bytes of the train state's shards as placed."""
    per: dict = {}
    for leaf in jax.tree.leaves(state):
        for s in leaf.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return max(per.values()), sum(per.values())


def _devices_ab(args: list[str], counts: list[int]) -> int:
    """One `bench step` subprocess per device count; a table of state memory per device."""
    rows = {}
    own = [a for a in cmdline.join_values(args, ["devices"]) if not a.startswith("--devices")]
    for n in counts:
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}",
               "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        proc = subprocess.run([sys.executable, "-m", "ppgd_tpu.cli", "bench", "step", *own],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
            if proc.returncode < 0:  # as a shell would say it, not as exit status 256 - N
                sys.stderr.write(f"bench step: the {n}-device run was killed by "
                                 f"{signal.Signals(-proc.returncode).name}\n")
                return 1
            return proc.returncode
        report = dict(line.split(None, 1) for line in proc.stdout.splitlines() if line.strip())
        rows[n] = {k: float(report[k]) for k in ("state_mb_per_device", "step_median_ms")
                   if k in report}
    base = min(rows)
    for n, r in rows.items():
        _print({"devices": n, **r, "state_shrink_vs_%d" % base:
                rows[base]["state_mb_per_device"] / r["state_mb_per_device"]})
    return 0


def bench_step(args: list[str]) -> int:
    from ppgd_tpu.data.toy import batch_key
    from ppgd_tpu.engine import Trainer

    cfg, extra = cmdline.parse_config_args(args, {
        "n_steps": ("200", "timed steps per measurement", cmdline.count),
        "devices": ("", "comma-separated device counts: compare state memory per device",
                    cmdline.counts),
        "timing": ("true", "time the steps (false: the placed state's memory only)",
                   cmdline.choice("true", "false")),
        "profile": ("", "also list the N XLA ops the step spends the most time in, from "
                    "a jax.profiler trace (empty: off)", cmdline.optional(cmdline.count))})
    if extra["devices"]:
        return _devices_ab(args, extra["devices"])
    n = extra["n_steps"]
    trainer = Trainer(cfg)
    target, dec = trainer.target, trainer.dec
    state = jax.block_until_ready(trainer.init_state())  # the faithfulness warmup too
    state_max, state_total = state_bytes_per_device(state)
    memory = {"config": cfg.name, "batch_size": cfg.data.batch_size,
              "devices": jax.device_count(),
              "mesh": "x".join(f"{a}={n}" for a, n in trainer.mesh.shape.items()),
              "state_mb_per_device": state_max / 2**20, "state_mb_total": state_total / 2**20}
    if extra["timing"] == "false":
        _print(memory)
        return 0

    t0 = time.perf_counter()
    with CompileCacheUse() as cache_use:
        state, m = trainer.replay.full(state, target, trainer.batch(0))
        jax.block_until_ready((state, m))
    compile_s = time.perf_counter() - t0
    for i in range(10):  # warm-up
        state, m = trainer.replay.full(state, target, trainer.batch(i))
    jax.block_until_ready(state)

    single = []
    for i in range(n):
        t = time.perf_counter()
        state, m = trainer.replay.full(state, target, trainer.batch(i))
        jax.block_until_ready((state, m))
        single.append(time.perf_counter() - t)

    t = time.perf_counter()
    for i in range(n):
        state, m = trainer.replay.full(state, target, trainer.batch(i))
    jax.block_until_ready((state, m))
    loop_s = (time.perf_counter() - t) / n

    B, seed = cfg.data.batch_size, cfg.seed
    lm = trainer.eval_labels is not None
    fixed = trainer.batch(0) if lm else None  # token batches come from the host

    def device_loop(st, tg, fixed):
        def body(i, s):
            x = fixed if fixed is not None else tg.sample(batch_key(seed, i), B)
            return dec.full(s, tg, x)[0]
        return jax.lax.fori_loop(0, n, body, st)

    # the state keeps its placement (the steps after this loop require it)
    run_loop = jax.jit(device_loop, donate_argnums=0,
                       out_shardings=jax.tree.map(lambda x: x.sharding, state))
    state = jax.block_until_ready(run_loop(state, target, fixed))  # compile
    t = time.perf_counter()
    state = jax.block_until_ready(run_loop(state, target, fixed))
    device_s = (time.perf_counter() - t) / n

    report = {
        **memory,
        "compile_s": compile_s,
        "compile_cache": cache_use.summary(),
        "step_median_ms": 1e3 * float(np.median(single)),
        "step_p90_ms": 1e3 * float(np.percentile(single, 90)),
        "loop_step_ms": 1e3 * loop_s,
        "device_only_step_ms": 1e3 * device_s,
        "host_overhead_share": max(0.0, 1.0 - device_s / loop_s),
        "steps_per_s": 1.0 / loop_s,
        "peak_rss_mb": _peak_rss_mb(),
    }
    # after the RSS sample: the FLOP count compiles the step once more
    report.update(step_rate(trainer, state, float(np.median(single))))
    # the A/Bs and the profile before the split, which donates `state`
    live_rows = live_rows_ab(trainer, state, n)
    ppgd = persistent_pgd_ab(trainer, state, n, report["matmul_2048_gflop_per_s"])
    ops = op_profile(trainer, state, n, extra["profile"]) if extra["profile"] else []
    report.update(ci_fn_split(trainer, state, n))  # toys too: where the CI fn's time goes
    report.update(live_rows)
    report.update(ppgd)
    _print(report)
    if ops:
        _print_ops(ops)
    return 0


class CompileCacheUse:
    """Counts, while entered, the programs JAX's persistent compile cache was asked for and
    how many it loaded: a compile_s from a warm cache is a load (~2x less; cache.py)."""

    def __enter__(self):
        self.counts = collections.Counter()
        jax.monitoring.register_event_listener(self._count)
        return self

    def _count(self, event: str, **_) -> None:
        self.counts[event] += 1

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_listener(self._count)

    def summary(self) -> str:
        asked = self.counts["/jax/compilation_cache/compile_requests_use_cache"]
        if not asked:
            return "off"
        loaded = self.counts["/jax/compilation_cache/cache_hits"]
        return f"{'warm' if loaded == asked else 'cold'}: {loaded} of {asked} programs loaded"


_HLO_OP = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\(")


def _hlo_ops(hlo_text: str) -> dict[str, tuple[str, str, str]]:
    """{instruction name: (opcode, shape, the JAX op it lowers)} of a compiled HLO module."""
    ops = {}
    for line in hlo_text.splitlines():
        if m := _HLO_OP.match(line):
            name, shape, opcode = m.groups()
            src = re.search(r'op_name="([^"]*)"', line)
            ops[name] = (opcode, re.sub(r"\{[^}]*\}", "", shape)[:48],
                         src.group(1).split("/", 1)[-1] if src else "")
    return ops


def op_profile(trainer, state, n: int, top: int) -> list[tuple]:
    """The `top` XLA ops of the jitted step by CPU time per step (summed over the threads
    that ran them), from a jax.profiler trace of n steps: (ms/step, calls/step, name, opcode,
    shape, JAX op). A while/conditional's time includes the ops of its body."""
    step = jax.jit(trainer.dec.full, donate_argnums=0).lower(
        state, trainer.target, trainer.batch(0)).compile()
    ops = _hlo_ops(step.as_text())
    st = jax.block_until_ready(step(jax.tree.map(jnp.copy, state), trainer.target,
                                    trainer.batch(0))[0])
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d)
        for i in range(n):
            st = step(st, trainer.target, trainer.batch(i))[0]
        jax.block_until_ready(st)
        jax.profiler.stop_trace()
        traces = sorted(pathlib.Path(d).rglob("*.trace.json.gz"))
        if not traces:
            raise RuntimeError(f"jax.profiler wrote no *.trace.json.gz under {d}")
        events = json.loads(gzip.decompress(traces[0].read_bytes()))["traceEvents"]
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("name") in ops:
            total[e["name"]] += e["dur"]
            calls[e["name"]] += 1
    return [(total[k] / n / 1e3, calls[k] / n, k, *ops[k]) for k, _ in total.most_common(top)]


def _print_ops(rows: list[tuple]) -> None:
    print("\nXLA ops by time per step: CPU time summed over the threads that ran the op (one "
          "split over 2 threads counts twice); a while/conditional: its wall time, body "
          "included")
    print(f"{'ms/step':>8}  {'calls':>6}  op / opcode / shape / from")
    for ms, calls, name, opcode, shape, src in rows:
        print(f"{ms:8.3f}  {calls:6.1f}  {name}  {opcode}  {shape}  {src}")


def _xla_gflop(compiled) -> float:
    """XLA's static FLOP count of one call of a compiled program, in GFLOP. It counts a while
    loop's body ONCE (a scan over n blocks as one block), and a conditional as its costliest
    branch."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # older jaxlibs: one per device
    return float(cost.get("flops", 0.0)) / 1e9


def _matmul_gflop(compiled) -> float:
    """The matmul FLOPs of one call of a compiled program, in GFLOP, each loop body counted
    by its trip count (hlo.Module.dot_flops): the work a matmul rate is the roofline for. A
    conditional counts every branch: a live-rows step counts its live-rows recon AND its
    every-row fallback, an upper bound."""
    return hlo.Module(compiled.as_text()).dot_flops() / 1e9


def _paired_rounds(trainer, steps: dict, n: int) -> tuple[dict, dict]:
    """Per-step seconds of each {name: (step fn, state)} on the same data, in n // 20
    rounds of 20 steps (one round of all n when n < 20) alternating which goes first
    (machine noise moves them alike); -> ({name: [s per round]}, {name: GFLOP per step}).
    Each is compiled as the loop jits its steps, donating its own copy of the state (a
    donated state's outputs are written into its buffers: with the live-rows switch that
    is one more pass over each `bsc` adversary array)."""
    batch0 = trainer.batch(0)
    steps = {k: (jax.jit(f, donate_argnums=0).lower(st, trainer.target, batch0).compile(),
                 jax.tree.map(jnp.copy, st)) for k, (f, st) in steps.items()}
    gflop = {k: _matmul_gflop(f) for k, (f, _) in steps.items()}
    states = {k: jax.block_until_ready(f(st, trainer.target, batch0)[0])
              for k, (f, st) in steps.items()}
    times, size = {k: [] for k in steps}, min(20, n)
    for r in range(n // size):
        for k in (list(steps) if r % 2 == 0 else list(steps)[::-1]):
            st, t = states[k], time.perf_counter()
            for i in range(size):
                st = steps[k][0](st, trainer.target, trainer.batch(i))[0]
            states[k] = jax.block_until_ready(st)
            times[k].append((time.perf_counter() - t) / size)
    return times, gflop


def _ab_report(times: dict, a: str, b: str, ratio: str) -> dict:
    """Median step ms of `a` and `b` and the median of their per-round ratios."""
    return {f"{a}_step_ms": 1e3 * float(np.median(times[a])),
            f"{b}_step_ms": 1e3 * float(np.median(times[b])),
            ratio: float(np.median(np.array(times[a]) / np.array(times[b])))}


def live_rows_ab(trainer, state, n: int) -> dict:
    """When the step runs its recon on the live rows (decomp/live_rows.py): that step vs the
    same step on every row; the median of the per-round ratios is the number to compare.
    Empty when the step runs on every row anyway."""
    dec = trainer.dec
    if not dec.skip_dead_rows:
        return {}
    every_row = copy.copy(dec)
    every_row.skip_dead_rows = False
    times, _ = _paired_rounds(trainer, {"live_rows": (dec.full, state),
                                        "all_rows": (every_row.full, state)}, n)
    return {"live_rows_of_batch": dec.live_sizes[0],
            **_ab_report(times, "live_rows", "all_rows", "live_rows_ratio")}


def step_rate(trainer, state, step_s: float) -> dict:
    """The FLOPs of one full step as the loop compiles it and the rate a step of `step_s`
    seconds runs them at, beside a 2048^3 fp32 matmul's rate now
    (`matmul_2048_gflop_per_s`: the rate this machine reaches on the most favourable work).
    `xla_gflop`: XLA's own count (`_xla_gflop`: a scanned block counted once);
    `matmul_gflop`: the step's matmuls with loops counted (`_matmul_gflop`);
    `achieved_gflop_per_s` = matmul_gflop / step_s, the number to hold against the matmul
    rate (a live-rows step counts both its branches: there it is an upper bound)."""
    compiled = trainer.replay.full.lower(state, trainer.target, trainer.batch(0)).compile()
    gflop = _matmul_gflop(compiled)
    return {"xla_gflop": _xla_gflop(compiled), "matmul_gflop": gflop,
            "achieved_gflop_per_s": gflop / step_s,
            "matmul_2048_gflop_per_s": matmul_rate(2048)}


def persistent_pgd_ab(trainer, state, n: int, matmul_gflop_per_s: float) -> dict:
    """With persistent-PGD terms: the step vs the same step without them (nor their
    adversaries), paired as in `live_rows_ab`: `persistent_pgd_ratio` is what the terms
    cost. Without a live-rows switch also the matmul FLOPs of each (`_matmul_gflop`) and the
    rate the terms' added FLOPs run at (beside `matmul_gflop_per_s`, the caller's 2048^3
    matmul rate): how far the ratio could fall by running them faster. Empty without such
    terms."""
    from ppgd_tpu.step import Decomposer

    cfg = trainer.cfg
    if not cfg.loss.persistent_pgd:
        return {}
    plain_cfg = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, persistent_pgd={}))
    plain = Decomposer(plain_cfg, trainer.target, trainer.data.batch_shape)
    no_adv = eqx.tree_at(lambda s: s.adversaries, state, {})
    times, gflop = _paired_rounds(trainer, {"with_ppgd": (trainer.dec.full, state),
                                            "without_ppgd": (plain.full, no_adv)}, n)
    report = _ab_report(times, "with_ppgd", "without_ppgd", "persistent_pgd_ratio")
    if trainer.dec.skip_dead_rows or plain.skip_dead_rows:
        return report  # a live-rows switch counts both its branches
    report.update({f"{k}_matmul_gflop": v for k, v in gflop.items()})
    added_s = 1e-3 * (report["with_ppgd_step_ms"] - report["without_ppgd_step_ms"])
    if added_s > 0:  # the rate the terms' own work runs at, against the best matmul rate
        report["ppgd_added_gflop_per_s"] = (gflop["with_ppgd"] - gflop["without_ppgd"]) / added_s
    return report


def matmul_rate(n: int, reps: int = 10) -> float:
    """GFLOP/s of an fp32 [n, n] x [n, n] matmul (best of `reps`): a roofline for the rest."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(jnp.matmul)
    jax.block_until_ready(f(a, a))
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(a, a))
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best / 1e9


def ci_fn_split(trainer, state, n: int) -> dict:
    """The CI fn's share of a step: the full step vs the repeat step on a cached envelope
    (which skips the taps and the CI fn's forward and backward [W3]), both on data batch 0,
    medians of individually timed steps."""
    target, replay = trainer.target, trainer.replay
    batch = trainer.batch(0)
    env = replay.compute_ci(target, state, batch)

    def timed(run, state):
        state, m = run(state)  # compile / warm up
        jax.block_until_ready((state, m))
        times = []
        for _ in range(n):
            t = time.perf_counter()
            state, m = run(state)
            jax.block_until_ready((state, m))
            times.append(time.perf_counter() - t)
        return state, float(np.median(times))

    state, full_s = timed(lambda st: replay.full(st, target, batch), state)
    state, repeat_s = timed(lambda st: replay.repeat((target, env), st, batch), state)
    return {"full_step_ms": 1e3 * full_s, "repeat_step_ms": 1e3 * repeat_s,
            "ci_fn_ms": 1e3 * (full_s - repeat_s),
            "ci_fn_share": max(0.0, 1.0 - repeat_s / full_s)}


def _window(text: str) -> int:
    try:
        k = cmdline.count(text)
    except ValueError:
        k = 0
    if k < 2:
        raise ValueError("use a whole number >= 2 (a window of 1 replays nothing)")
    return k


def _rotating_rounds(runs: dict, rounds: int) -> tuple[dict[str, list[float]], int]:
    """Seconds of each {name: run(w)} in each of `rounds` rounds, after one untimed round
    (w = 0: it compiles what each run uses). Round r runs every name once, on w = r + 1, in
    the names' order rotated by r, so a load change within a round moves every name alike
    and each name takes each place in turn; each run must block until its work is done.
    -> ({name: [s per round]}, programs compiled or loaded from a compile cache during the
    timed rounds: 0 unless a run compiles past its first call)."""
    names = list(runs)
    for name in names:
        runs[name](0)
    times = {name: [] for name in names}
    with CompileCount() as compiles:
        for r in range(rounds):
            j = r % len(names)
            for name in names[j:] + names[:j]:
                t = time.perf_counter()
                runs[name](r + 1)
                times[name].append(time.perf_counter() - t)
    return times, compiles.n


class CompileCount:
    """Counts, while entered, the programs JAX compiles or loads from a compile cache."""

    def __enter__(self):
        self.n = 0
        jax.monitoring.register_event_duration_secs_listener(self._count)
        return self

    def _count(self, event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.n += 1

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._count)


def bench_replay(args: list[str]) -> int:
    """Replay A/B in one process, compiles excluded.

    - `full_step_ms`, `repeat_step_ms`, `repeat_over_full` (and the CI fn's share): the full
      vs the repeat step on one batch, `ci_fn_split`.
    - `window_step_ms/<mode>`: the per-step time of a whole window of k steps in each
      CI-update mode, each mode on its own copy of the state (its variants donate it). The
      modes run interleaved: `rounds` rounds, each one window of every mode in an order that
      rotates per round (`_rotating_rounds`), after one untimed window of each that
      compiles every variant the mode uses. Each is the median over rounds;
      `window_step_vs_every/<mode>` is the median of the per-round ratios to `every`'s
      window of the same round (paired in time).
    - `step_ms/first_full`, `step_ms/first_repeat`: `first`'s own variants alone, the
      full step that keeps its envelope and the repeat step on it, each timed as k steps
      back to back in the same rounds; `repeat_over_full/first` the median of their per-round
      ratios; `window_step_ideal/first` = (1 + (k-1) repeat_over_full/first) / k: the window
      ratio `first` would reach if its window cost one of its full steps plus k-1 repeats
      and `every`'s step cost as much as that full step. Measured above ideal: the window
      costs more than its steps alone, or `first`'s full step more than `every`'s.
    - `compiles_while_timed`: programs compiled (or loaded from the compile cache) during
      the timed rounds; 0 unless a variant recompiles past its first window."""
    from ppgd_tpu import config as config_lib
    from ppgd_tpu.engine import Trainer
    from ppgd_tpu.replay import POLICIES, ReplayController
    from ppgd_tpu.step import Decomposer

    cfg, extra = cmdline.parse_config_args(args, {
        "k": ("4", "replay window length (>= 2: a window of 1 replays nothing)", _window),
        "rounds": ("5", "timed rounds, each one window of every mode, interleaved",
                   cmdline.count)})
    k, rounds = extra["k"], extra["rounds"]

    def with_mode(mode):
        return config_lib.with_overrides(cfg, {
            "data.train_batch_replay": k, "data.replay_ci_update": mode,
            "decomp.steps": max(cfg.decomp.steps - cfg.decomp.steps % k, k),
            "decomp.ci_fn.detach_inputs": True})

    trainer = Trainer(with_mode("every"))
    state = trainer.init_state()
    # ci_fn_split donates the state it is given: hand it a copy
    report = {"config": cfg.name, "k": k, **ci_fn_split(trainer, jax.tree.map(jnp.copy, state), 5)}
    report["repeat_over_full"] = report["repeat_step_ms"] / report["full_step_ms"]
    target = trainer.target
    modes = tuple(POLICIES)
    ctls = {mode: ReplayController(Decomposer(with_mode(mode), target,
                                              trainer.data.batch_shape))
            for mode in modes}
    # every run starts from the same state, a copy of its own (every variant donates it)
    states = {name: jax.tree.map(jnp.copy, state)
              for name in (*modes, "first_full", "first_repeat")}
    first = ctls["first"]
    env = {}  # the envelope `first_repeat` replays, kept by `first_full`'s last step

    # each run: window w (global steps w k .. w k + k - 1, data batch w), as the loop runs it
    def window(mode):
        def run(w):
            st = states[mode]
            for s in range(w * k, w * k + k):
                st, m = ctls[mode].step(s, st, target, trainer.batch(s // k))
            states[mode] = jax.block_until_ready((st, m))[0]
        return run

    def first_full(w):
        st = states["first_full"]
        for s in range(w * k, w * k + k):
            st, env["first"], m = first.full_keep(st, target, trainer.batch(s // k))
        states["first_full"] = jax.block_until_ready((st, env["first"], m))[0]

    def first_repeat(w):
        st = states["first_repeat"]
        for s in range(w * k, w * k + k):
            st, m = first.repeat((target, env["first"]), st, trainer.batch(s // k))
        states["first_repeat"] = jax.block_until_ready((st, m))[0]

    runs = {mode: window(mode) for mode in modes}
    runs.update(first_full=first_full, first_repeat=first_repeat)
    times, compiles = _rotating_rounds(runs, rounds)
    per_step = {name: np.array(t) / k for name, t in times.items()}
    report["rounds"] = rounds
    for mode in modes:
        report[f"window_step_ms/{mode}"] = 1e3 * float(np.median(per_step[mode]))
    for mode in modes[1:]:
        report[f"window_step_vs_every/{mode}"] = float(np.median(per_step[mode]
                                                                 / per_step["every"]))
    full, repeat = per_step["first_full"], per_step["first_repeat"]
    report["step_ms/first_full"] = 1e3 * float(np.median(full))
    report["step_ms/first_repeat"] = 1e3 * float(np.median(repeat))
    # the ideal is monotone in repeat / full: its median is the ideal of the median ratio
    report["repeat_over_full/first"] = float(np.median(repeat / full))
    report["window_step_ideal/first"] = (1 + (k - 1) * report["repeat_over_full/first"]) / k
    report["compiles_while_timed"] = compiles
    _print(report)
    return 0


def _fresh_dir(path: str, prefix: str) -> str:
    """`--run_dir` of a bench that writes one (a new temp dir when empty): a path that does
    not exist yet, or an empty directory. A bench's saves in a run's dir would retire the
    run's own checkpoints and leave the run to resume from the bench's; its timing of a
    complete run would time nothing."""
    if not path:
        return tempfile.mkdtemp(prefix=prefix)
    if storage.is_gcs(path) and storage.list_entries(path) or \
            not storage.is_gcs(path) and os.path.isdir(path) and os.listdir(path):
        raise cmdline.UsageError(f"--run_dir: {path} is not empty; a bench writes a run dir of "
                                 "its own: pass a new path, or none (a temp dir)")
    return cmdline.output_path("run_dir", path, directory=True)


def bench_run(args: list[str]) -> int:
    """`--compile_cache=cold` (default) times a first run (a fresh, empty compile cache);
    `warm` a repeat run (one untimed run fills a fresh cache first); `off` runs without one."""
    cfg, extra = cmdline.parse_config_args(args, {
        "run_dir": ("", "run dir (default: a new temp dir, kept for a look; the output's "
                    "run_dir names it)"),
        "compile_cache": ("cold", "cold: first run; warm: a repeat run; off: no cache",
                          cmdline.choice("cold", "warm", "off"))})
    mode = extra["compile_cache"]
    run_dir = _fresh_dir(extra["run_dir"], "ppgd-bench-run-")
    own = [a for a in cmdline.join_values(args, ["run_dir", "compile_cache"])  # both spellings
           if not a.startswith(("--run_dir=", "--compile_cache="))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    scratch = tempfile.mkdtemp(prefix="ppgd-bench-run-")  # the cache, a warm run's first run
    env["PPGD_TPU_COMPILE_CACHE"] = "off" if mode == "off" else os.path.join(scratch, "xla")

    def train(run_dir):
        cmd = [sys.executable, "-m", "ppgd_tpu.cli", "train", f"--run_dir={run_dir}",
               "--log.progress=false", *own]
        t = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=env)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-4000:])
        return proc.returncode, time.perf_counter() - t

    try:
        if mode == "warm":
            rc, _ = train(os.path.join(scratch, "fill"))
            if rc != 0:
                return rc
        rc, wall = train(run_dir)
        if rc != 0:
            if not extra["run_dir"]:  # our temp dir, with nothing worth a look
                shutil.rmtree(run_dir, ignore_errors=True)
            return rc
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    with open(os.path.join(run_dir, workspace.SUMMARY)) as fh:
        summary = json.load(fh)
    _print({"config": cfg.name, "steps": cfg.decomp.steps, "compile_cache": mode,
            "wall_s": wall, "steps_per_s_overall": cfg.decomp.steps / wall,
            "peak_rss_mb": _peak_rss_mb(resource.RUSAGE_CHILDREN), "run_dir": run_dir,
            **{k: v for k, v in summary.items()
               if k.startswith(("eval/recon", "eval/kl", "eval/ce"))}})
    return 0


def bench_ckpt(args: list[str]) -> int:
    """Per save: time the loop blocks (device-to-host copy), background write+commit time,
    bytes, and the share of the window state (replay envelope / accumulator) in them."""
    from ppgd_tpu import checkpoint, resume
    from ppgd_tpu.engine import Trainer

    cfg, extra = cmdline.parse_config_args(args, {
        "n_saves": ("5", "saves to time", cmdline.count),
        "run_dir": ("", "where to write (default: a new temp dir, kept; the output's run_dir "
                    "names it)")})
    run_dir = _fresh_dir(extra["run_dir"], "ppgd-bench-ckpt-")
    trainer = Trainer(cfg)
    state = trainer.init_state()
    k = cfg.data.train_batch_replay
    block, commit, sizes, window_bytes = [], [], [], []
    with checkpoint.Checkpointer(run_dir, keep_last_n=2) as saver:
        for i in range(extra["n_saves"]):
            # contiguous steps, stopping mid-window (k > 1) before each save
            for s in range(int(state.step), i * k + k // 2 + 1):
                state, _ = trainer.replay.step(s, state, trainer.target, trainer.batch(s // k))
            leaves = resume.checkpoint_leaves(state, trainer.replay)
            jax.block_until_ready(leaves)
            t = time.perf_counter()
            saver.save(int(state.step), leaves)
            block.append(time.perf_counter() - t)
            t = time.perf_counter()
            saver.wait()
            commit.append(time.perf_counter() - t)
            sizes.append(checkpoint.ls(run_dir)[-1].bytes)
            window_bytes.append(sum(np.asarray(v).nbytes for n, v in leaves.items()
                                    if n.startswith("training/replay/")))
    _print({"config": cfg.name, "replay": f"{cfg.data.replay_ci_update} k={k}",
            "loop_block_ms_median": 1e3 * float(np.median(block)),
            "background_commit_ms_median": 1e3 * float(np.median(commit)),
            "bytes_per_checkpoint": int(np.median(sizes)),
            "window_state_bytes": int(np.median(window_bytes)), "run_dir": run_dir})
    return 0


CASES = {"step": bench_step, "run": bench_run, "ckpt": bench_ckpt, "replay": bench_replay}


def _print(report: dict) -> None:
    width = max(len(k) for k in report)
    for k, v in report.items():
        v = f"{v:.4g}" if isinstance(v, float) else v
        print(f"{k.ljust(width)}  {v}")


def main(case: str, args: list[str]) -> int:
    if case not in CASES:
        raise cmdline.UsageError(f"unknown case {case!r}; one of {', '.join(CASES)}")
    return CASES[case](args)
