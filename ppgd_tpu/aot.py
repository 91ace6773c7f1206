"""`ppgd-tpu compile`: a run's programs compiled for a TPU pod, on any machine.

    ppgd-tpu compile --config X --topology v4-32 [--slices 2] [--json PATH] [config flags]

The train path with shapes instead of arrays: the config's target is built under
`eval_shape` (no weights, store or target file), the mesh is made by the run's own rules
(mesh.make_mesh: ICI within a slice, DCN across slices) over the devices of a TPU topology
that libtpu's compiler describes without a TPU, and `Programs` (programs.py) jits every
step variant the config's replay mode runs (replay.POLICIES) and the fast eval with the
shardings and donation `train` uses. Each is lowered and compiled by the real TPU compiler.

Per variant it reports: compile time; per-chip memory (arguments, outputs, temporaries,
aliased, generated code, peak) against the chip's HBM; matmul FLOPs and HBM bytes per chip
counted from the optimised HLO with loop trip counts (hlo.py; XLA's own counts, which take a
loop body once, beside them), the roofline lower bound max(FLOPs / peak bf16 FLOP/s, bytes /
HBM bandwidth);
the global FLOPs of the traced program over the chips against the per-chip count
(`flops_balance`: ~1 when every chip computes its share of the batch, ~1/chips when each
computes all of it); collectives (count, bytes); and the donation check [W5]: every
train-state leaf aliased input to output where the variant donates the state, the
(model, envelope) argument never.

Exit 0 when every variant fits with `--headroom` (default 10%) of HBM to spare; 1 naming
the variant, its overflow and a hint from what was measured; 2 for a bad topology, flag
or config (before any compile).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import time

import jax
import numpy as np

from ppgd_tpu import cmdline, hlo
from ppgd_tpu import mesh as mesh_lib
from ppgd_tpu.config import Config


@dataclasses.dataclass(frozen=True)
class Chip:
    """One JAX device of a TPU generation (a megacore chip on v4/v5p): HBM, peak dense
    bf16 matmul rate and HBM bandwidth, from the vendor's published figures."""

    kind: str
    hbm_gib: float
    bf16_tflop_per_s: float
    hbm_gb_per_s: float
    grid_dims: int  # 3: a 3-D torus of chips (v4, v5p); 2: a 2-D one (v5e, v6e)
    cores_per_chip: int  # TensorCores per chip, as the accelerator type counts them


CHIPS = {
    "v4": Chip("TPU v4", 32, 275, 1228, 3, 2),
    "v5p": Chip("TPU v5p", 95, 459, 2765, 3, 2),
    "v5e": Chip("TPU v5e", 16, 197, 819, 2, 1),
    "v6e": Chip("TPU v6e", 32, 918, 1640, 2, 1),
}
_NAMES = {"v4": "v4", "v5p": "v5p", "v5e": "v5e", "v5litepod": "v5e", "v6e": "v6e"}
_COUNTS = {3: [2 ** i for i in range(2, 13)], 2: [1] + [2 ** i for i in range(2, 9)]}


class TopologyError(cmdline.UsageError):
    """An accelerator type that is not a TPU slice this command knows."""


def known_topologies() -> list[str]:
    return [f"{name}-{n * CHIPS[gen].cores_per_chip}" for name, gen in _NAMES.items()
            for n in _COUNTS[CHIPS[gen].grid_dims]]


def _grid(chips: int, dims: int) -> tuple[int, ...]:
    """The slice's chip grid: 3-D from 2x2x1, 2-D from 1x1 / 2x2, doubling the last of the
    smallest dims (2x2x4 -> 2x4x4, 4x4 -> 4x8), as GCP's slice shapes go."""
    grid = [1, 1] if dims == 2 else [2, 2, 1]
    if dims == 2 and chips > 1:
        grid = [2, 2]
    while math.prod(grid) < chips:
        i = max(j for j, g in enumerate(grid) if g == min(grid))
        grid[i] *= 2
    return tuple(grid)


@dataclasses.dataclass(frozen=True)
class Topology:
    """A slice type as `gcloud` names it (v4-32: 32 TensorCores = 16 chips; v5e-16 /
    v5litepod-16: 16 chips), times `slices` joined by DCN."""

    name: str
    chip: Chip
    chips: int
    slices: int

    @classmethod
    def parse(cls, name: str, slices: int = 1) -> "Topology":
        m = re.fullmatch(r"(v4|v5p|v5e|v5litepod|v6e)-(\d+)", name.strip())
        chip = CHIPS[_NAMES[m.group(1)]] if m else None
        n = int(m.group(2)) // chip.cores_per_chip if m else 0
        if not m or n not in _COUNTS[chip.grid_dims] or int(m.group(2)) % chip.cores_per_chip:
            raise TopologyError(f"--topology: {name!r} is not a TPU slice type this command "
                                f"knows; use one of {', '.join(known_topologies())}")
        return cls(name, chip, n, slices)

    def devices(self) -> list:
        """The topology's compile-only devices (libtpu's compiler; no TPU needed)."""
        if importlib.util.find_spec("libtpu") is None:
            raise cmdline.UsageError("compile: the TPU compiler (libtpu) is not installed; "
                                     "install it with `pip install -e '.[tpu]'` (it runs on a "
                                     "machine without a TPU)")
        # libtpu's lock keeps two processes off one host's TPU chips; a compile-only client
        # touches none (and may run beside a training job, or another compile)
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        from jax.experimental import topologies

        gen = [g for g, c in CHIPS.items() if c is self.chip][0]
        grid = _grid(self.chips, self.chip.grid_dims)
        kwargs = {"num_slices": self.slices} if self.slices > 1 else {}
        if self.chip.grid_dims == 3:
            kwargs["chip_config_name"] = "megacore"
        if self.chips < 4:
            kwargs["chips_per_host_bounds"] = (*grid, 1)
        elif self.chips == 8 and self.chip.grid_dims == 2:  # one host of 8 chips
            kwargs["chips_per_host_bounds"] = (2, 4, 1)
        desc = topologies.get_topology_desc(
            platform="tpu", topology_name=f"{gen}:{'x'.join(map(str, grid))}", **kwargs)
        return list(desc.devices)


# ---------------------------------------------------------------- what is compiled


def _abstract_target(cfg: Config):
    from ppgd_tpu.targets import build

    mod, sub = build.KINDS[cfg.target.kind], getattr(cfg.target, cfg.target.kind)
    return jax.eval_shape(lambda: mod.init(sub, jax.random.key(0)))


def variants(cfg: Config, programs, target) -> dict[str, tuple]:
    """{name: (jitted program, abstract args, index of the train-state arg, index of the
    (model, envelope) arg or None)} of every program a run of `cfg` runs each step or
    eval (replay.POLICIES[mode].programs(), then `eval`); `target` abstract, as `programs`
    was built with."""
    from ppgd_tpu.replay import POLICIES, window_template

    dec, replay, b = programs.dec, programs.replay, programs.batches
    state = jax.eval_shape(dec.init, target)
    w = window_template(dec, target, b.train, replay.held)
    table = {
        "full": ((state, target, b.train), 0, None),
        "full_keep": ((state, target, b.train), 0, None),
        "compute_ci": ((target, state, b.train), 1, None),
        "repeat": (((target, w.envelope), state, b.train), 1, 0),
        "mean_accum": (((target, w.envelope), state, w.accumulator, b.train), 1, 0),
        "mean_update": (((target, w.envelope, w.envelope_V), state, w.accumulator, b.train),
                        1, 0),
    }
    out = {v: (getattr(replay, v), *table[v])
           for v in POLICIES[cfg.data.replay_ci_update].programs()}
    out["eval"] = (programs.fast_eval, (state, target, b.eval, b.eval_labels), 0, None)
    return out


def _jaxpr_flops(jaxpr) -> float:
    """Global matmul FLOPs of a traced program: dot_generals, scans times their length,
    a cond's costliest branch."""
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (lc, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in lc)
            continue
        subs = [p for v in eqn.params.values()
                for p in (v if isinstance(v, (list, tuple)) else [v])
                if hasattr(p, "eqns") or hasattr(getattr(p, "jaxpr", None), "eqns")]
        counts = [_jaxpr_flops(getattr(p, "jaxpr", p)) for p in subs]
        if not counts:
            continue
        if eqn.primitive.name == "cond":
            total += max(counts)
        else:
            total += sum(counts) * (eqn.params.get("length", 1)
                                    if eqn.primitive.name == "scan" else 1)
    return total


def _donation(lowered, compiled_hlo: hlo.Module, args, state_arg, model_arg) -> dict:
    """Which train-state and (model, envelope) leaves are donated and aliased."""
    kept = sorted(lowered._lowering.compile_args.get("kept_var_idx", ()))
    param = {flat: n for n, flat in enumerate(kept)}
    aliased = compiled_hlo.aliased_parameters()
    infos = jax.tree.leaves(lowered.args_info[0])  # the flat args' order, as `kept`
    spans, start = [], 0
    for a in args:
        n = len(jax.tree.leaves(a))
        spans.append(range(start, start + n))
        start += n

    def check(i):
        flat = spans[i]
        return {"leaves": len(flat), "donated": sum(bool(infos[j].donated) for j in flat),
                "aliased": sum(param.get(j) in aliased for j in flat),
                "unused": sum(j not in param for j in flat)}

    out = {"state": check(state_arg)}
    if model_arg is not None:
        out["model_envelope"] = check(model_arg)
    state = out["state"]
    donates_state = state["donated"] > 0
    out["ok"] = (not donates_state or state["aliased"] == state["leaves"] - state["unused"]) \
        and out.get("model_envelope", {}).get("aliased", 0) == 0 \
        and out.get("model_envelope", {}).get("donated", 0) == 0
    return out


def _shard_bytes(struct, sharding) -> int:
    return int(np.prod(sharding.shard_shape(tuple(struct.shape)))) * np.dtype(
        struct.dtype).itemsize


def state_per_chip(programs, target) -> list[tuple[str, int, bool]]:
    """(leaf, bytes per chip, sharded?) of the train state, largest first."""
    from ppgd_tpu import resume

    state = resume.state_leaves(jax.eval_shape(programs.dec.init, target))
    shardings = resume.state_leaves(programs.shardings.state)
    rows = [(name, _shard_bytes(s, shardings[name]), not shardings[name].is_fully_replicated)
            for name, s in state.items()]
    return sorted(rows, key=lambda r: -r[1])


def compile_variant(topo: Topology, name: str, fn, args, state_arg, model_arg) -> dict:
    chip, n_chips = topo.chip, topo.chips * topo.slices
    t0 = time.perf_counter()
    traced = fn.trace(*args)
    lowered = traced.lower()
    t1 = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # XLA's RESOURCE_EXHAUSTED and friends: the reason is the text
        return {"variant": name, "error": str(e).splitlines()[0][:400],
                "lower_s": t1 - t0, "compile_s": time.perf_counter() - t1}
    t2 = time.perf_counter()
    mem = compiled.memory_analysis()
    module = hlo.Module(compiled.as_text())
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    flops = module.dot_flops()
    xla_flops, xla_bytes = float(cost.get("flops", 0.0)), float(cost.get("bytes accessed", 0.0))
    bytes_est = module.bytes_accessed()
    global_flops = _jaxpr_flops(traced.jaxpr.jaxpr)
    hbm = chip.hbm_gib * 2**30
    peak = int(mem.peak_memory_in_bytes)
    compute_s = flops / (chip.bf16_tflop_per_s * 1e12)
    memory_s = bytes_est / (chip.hbm_gb_per_s * 1e9)
    return {
        "variant": name, "lower_s": t1 - t0, "compile_s": t2 - t1,
        "memory": {"argument": mem.argument_size_in_bytes, "output": mem.output_size_in_bytes,
                   "temp": mem.temp_size_in_bytes, "alias": mem.alias_size_in_bytes,
                   "generated_code": mem.generated_code_size_in_bytes, "peak": peak},
        "peak_gib": peak / 2**30, "hbm_gib": chip.hbm_gib, "peak_frac_hbm": peak / hbm,
        "flops_per_chip": flops, "global_flops": global_flops,
        "flops_balance": global_flops / n_chips / flops if flops else None,
        "xla_flops_per_chip": xla_flops, "xla_bytes_per_chip": xla_bytes,
        "bytes_per_chip_est": bytes_est,
        "roofline_ms": 1e3 * max(compute_s, memory_s),
        "roofline_bound": "compute" if compute_s >= memory_s else "memory",
        "collectives": module.collectives(),
        "donation": _donation(lowered, module, args, state_arg, model_arg),
    }


# ---------------------------------------------------------------- the command


def _hint(cfg: Config, rows: list[tuple[str, int, bool]], report: dict, chips: int) -> str:
    """What the measurements say would make a variant fit."""
    state = sum(r[1] for r in rows)
    top = ", ".join(f"{n} {b / 2**30:.2f} GiB{' (replicated)' if chips > 1 and not sh else ''}"
                    for n, b, sh in rows[:3])
    words = [f"train state {state / 2**30:.2f} GiB per chip (largest: {top})"]
    replicated = sum(b for _, b, sh in rows if not sh)
    if chips > 1 and replicated > state / 2 and cfg.mesh.fsdp == 1 and cfg.mesh.dcn_fsdp == 1:
        words.append("most of it replicated: shard the weights and moments over the chips "
                     "with --mesh.data=1 --mesh.fsdp=-1")
    temp = report.get("memory", {}).get("temp", 0)
    if temp > state or "temporaries" in report.get("error", ""):
        words.append("the step's temporaries dominate: a smaller data.batch_size, "
                     "decomp.ci_fn.remat=true, or more chips (the batch rows split over "
                     "data x fsdp)")
    return "; ".join(words)


def _table(reports: list[dict]) -> str:
    """One row per variant; memory in GiB per chip, collectives as count / GiB per step."""
    head = ("variant", "compile s", "peak", "% HBM", "args", "out", "alias", "temps",
            "code MiB", "TFLOP/chip", "HBM GB/chip", "balance", "roofline ms", "all-gather",
            "all-reduce", "red-scatter", "all-to-all", "donation")
    rows = [head]
    gib = lambda b: f"{b / 2**30:.2f}"
    for r in reports:
        if "error" in r:
            rows.append((r["variant"], f"{r['compile_s']:.0f}", "FAILED", r["error"][:70]))
            continue
        m, c = r["memory"], r["collectives"]
        coll = lambda k: f"{c[k]['count']} / {c[k]['bytes'] / 2**30:.2f}"
        d = r["donation"]
        don = (f"{d['state']['aliased']}/{d['state']['leaves']} state aliased"
               if d["state"]["donated"] else "state not donated")
        if "model_envelope" in d:
            don += f", model+env {d['model_envelope']['aliased']} aliased"
        rows.append((r["variant"], f"{r['compile_s']:.0f}", gib(m["peak"]),
                     f"{100 * r['peak_frac_hbm']:.0f}", gib(m["argument"]), gib(m["output"]),
                     gib(m["alias"]), gib(m["temp"]), f"{m['generated_code'] / 2**20:.1f}",
                     f"{r['flops_per_chip'] / 1e12:.3f}", f"{r['bytes_per_chip_est'] / 1e9:.1f}",
                     f"{r['flops_balance']:.2f}" if r["flops_balance"] else "-",
                     f"{r['roofline_ms']:.1f} ({r['roofline_bound'][0]})",
                     coll("all-gather"), coll("all-reduce"), coll("reduce-scatter"),
                     coll("all-to-all"), don + ("" if d["ok"] else "  FAILED")))
    widths = [max(len(str(row[i])) for row in rows if i < len(row)) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip()
                     for row in rows)


def main(args: list[str]) -> int:
    cfg, extra = cmdline.parse_config_args(args, {
        "topology": ("", "TPU slice type as gcloud names it: v4-32, v5p-64, v5e-256 "
                     "(= v5litepod-256), v6e-16, ...", str),
        "slices": ("1", "slices joined by DCN (multi-slice)", cmdline.count),
        "headroom": ("0.1", "HBM fraction each variant must leave free to fit",
                     _fraction),
        "json": ("", "also write the whole report as JSON to this path", str),
        "variants": ("", "compile only these of the mode's variants and `eval` "
                     "(comma-separated; default: all)", str)})
    if not extra["topology"]:
        raise cmdline.UsageError("--topology: which TPU slice to compile for? e.g. --topology "
                                 "v4-32 (one of " + ", ".join(known_topologies()) + ")")
    topo = Topology.parse(extra["topology"], extra["slices"])
    # compile-only: the persistent CPU cache is no place for TPU executables
    jax.config.update("jax_enable_compilation_cache", False)
    only = [v for v in extra["variants"].split(",") if v]
    report = compile_config(cfg, topo, extra["headroom"], only)
    print(report["text"])
    if extra["json"]:
        from ppgd_tpu import storage

        storage.write_bytes(extra["json"], json.dumps(
            {k: v for k, v in report.items() if k != "text"}, indent=1).encode())
    if report["failed"]:
        print(f"ppgd-tpu compile: error: {report['failed']}", flush=True)
        return 1
    return 0


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0 <= v < 1:
        raise ValueError("use a fraction in [0, 1), e.g. 0.1")
    return v


def compile_config(cfg: Config, topo: Topology, headroom: float = 0.1,
                   only: list[str] | None = None) -> dict:
    """Compiles every variant of `cfg` (or those in `only`) for `topo`; the report (`text`:
    the table, `failed`: why one does not fit, or '')."""
    from ppgd_tpu.data import lm as data_lib
    from ppgd_tpu.programs import Batches, Programs

    devices = topo.devices()
    mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    mesh_lib.check_batches(cfg, mesh)
    target = _abstract_target(cfg)
    placement = mesh_lib.Placement(cfg, mesh, len(target.leading_shape((1, 1))))
    programs = Programs(cfg, placement, target, Batches(*data_lib.batch_structs(cfg, target)))
    rows = state_per_chip(programs, target)
    n = topo.chips * topo.slices
    reports = []
    failed = ""
    table = variants(cfg, programs, target)
    unknown = sorted(set(only or ()) - set(table))
    if unknown:
        raise cmdline.UsageError(f"--variants: {', '.join(unknown)} not run by replay mode "
                                 f"{cfg.data.replay_ci_update!r}; its variants: {', '.join(table)}")
    for name, (fn, args, state_arg, model_arg) in table.items():
        if only and name not in only:
            continue
        r = compile_variant(topo, name, fn, args, state_arg, model_arg)
        reports.append(r)
        if "error" in r and not failed:
            failed = (f"variant {name} does not compile for {topo.name}: {r['error']}; "
                      + _hint(cfg, rows, r, n))
        elif "error" not in r and not failed and r["peak_frac_hbm"] > 1 - headroom:
            failed = (f"variant {name} needs {r['peak_gib']:.2f} GiB per chip, "
                      f"{100 * r['peak_frac_hbm']:.0f}% of the {topo.chip.kind}'s "
                      f"{topo.chip.hbm_gib:g} GiB HBM (more than {100 * (1 - headroom):.0f}%)"
                      f"; " + _hint(cfg, rows, r, n))
        elif "error" not in r and not failed and not r["donation"]["ok"]:
            failed = f"variant {name}: donation check failed: {r['donation']}"
    state_gib = sum(r[1] for r in rows) / 2**30
    head = (f"{cfg.name} on {topo.name}" + (f" x {topo.slices} slices" if topo.slices > 1
                                            else "")
            + f": {n} chips ({topo.chip.kind}, {topo.chip.hbm_gib:g} GiB HBM, "
            f"{topo.chip.bf16_tflop_per_s:g} bf16 TFLOP/s, {topo.chip.hbm_gb_per_s:g} GB/s), "
            f"mesh {dict(mesh.shape)}, replay {cfg.data.replay_ci_update} "
            f"k={cfg.data.train_batch_replay}; train state {state_gib:.2f} GiB per chip")
    return {"config": cfg.name, "topology": topo.name, "slices": topo.slices, "chips": n,
            "chip": dataclasses.asdict(topo.chip), "mesh": dict(mesh.shape),
            "headroom": headroom, "state_gib_per_chip": state_gib,
            "state_leaves": [{"leaf": a, "bytes_per_chip": b, "sharded": c}
                             for a, b, c in rows],
            "variants": reports, "failed": failed,
            "text": head + "\n" + _table(reports)}
