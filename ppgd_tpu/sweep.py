"""`ppgd-tpu sweep`: one config's `train` at many seeds, and the table of what each recovered.

    ppgd-tpu sweep --config X --seeds 0-15 [--jobs N] [--output DIR] [config flags]

Runs `ppgd-tpu train --config X [config flags] --seed=S --run_dir=DIR/seed_S` for every S
in --seeds, each in its own process, N at a time (default 1); DIR defaults to
runs/sweep-<config name>. Each child's stdout and stderr go to DIR/logs/seed_S.log (not into
its run dir: a new run dir must be empty [WORKSPACE.md]).

Contract:
- The command line is checked as `train` checks it (same flags, same exit 2 naming the
  field) before any run starts; --seed and --run_dir are the sweep's to set and are refused.
- Resumable: a seed whose run dir holds summary.json (a complete run, workspace.RunDir) is
  not started again; its config is checked against this command's first (a trajectory field
  that differs exits 2 naming the run dir, before anything runs), as `train` would. A seed
  whose run dir holds an unfinished run is started again, and `train` resumes it.
- A seed whose `train` exits non-zero is a row with its exit status; the others still run,
  and the command then exits 1. Otherwise it exits 0.
- At the end it prints one table, a row per seed: its exit status and, from its
  summary.json, eval/recovered/*, eval/alive/*, eval/alive_sum_rel_error/* (how far the
  alive components' sum is from the site's weight), eval/identity_ci_error/*,
  eval/dense_ci_error/*, eval/mmcs/*, eval/ml2r/* (the keys it has), then per site and
  overall "recovered at k of n seeds" (n: every seed asked for; a failed seed is not a
  recovery). The same rows and rates go to DIR/sweep.json.
- SIGINT/SIGTERM stop it: the running children get SIGTERM (each saves a checkpoint and
  stops [C5]), are waited for, and the same sweep command resumes them.
Local output directories only (the logs are local files).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

from ppgd_tpu import cmdline, storage
from ppgd_tpu import config as config_lib

# summary.json key prefixes shown, in this order, and their column names.
METRICS = (("recovered", "rec"), ("alive", "alive"), ("alive_sum_rel_error", "sum_err"),
           ("identity_ci_error", "id_err"), ("dense_ci_error", "dense_err"), ("mmcs", "mmcs"),
           ("ml2r", "ml2r"))
OWN_FLAGS = ("seeds", "jobs", "output")
LOGS = "logs"
RESULT = "sweep.json"


def parse_seeds(text: str) -> list[int]:
    """`0-15`, `0,3,7` or a mix (`0-3,8,10-11`) -> the seeds, ascending, each once; raises
    ValueError saying what is valid (a seed is a whole number in config's seed range)."""
    usage = "use seeds like 0-15, 0,3,7 or 0-3,8 (whole numbers >= 0)"
    if not text.strip():
        raise ValueError(f"which seeds? {usage}")
    out: set[int] = set()
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.strip().isdigit() or (sep and not hi.strip().isdigit()):
            raise ValueError(f"{part.strip()!r} is not a seed or a range; {usage}")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"{part.strip()!r} is an empty range (write it low-high); {usage}")
        if b > config_lib.SEED_MAX:
            raise ValueError(f"{b} is above the largest seed, {config_lib.SEED_MAX}")
        out.update(range(a, b + 1))
    return sorted(out)


def _train_args(args: list[str]) -> list[str]:
    """The command line without the sweep's own flags: what every seed's `train` gets."""
    args = cmdline.join_values(args, ["config", *OWN_FLAGS])
    own = tuple(f"--{n}=" for n in OWN_FLAGS)
    return [a for a in args if not a.startswith(own) and a not in {f"--{n}" for n in OWN_FLAGS}]


def summary_row(summary: dict) -> dict:
    """The table's keys of a summary.json: eval/<metric>/<site> for the METRICS it has."""
    return {k: v for k, v in summary.items()
            if k.startswith(tuple(f"eval/{m}/" for m, _ in METRICS))}


def rates(rows: list[dict]) -> dict:
    """{site: {recovered: k, of: n, seeds: [...]}} for each site with an eval/recovered key,
    and `all` (every such site recovered); n counts every row, failed ones included."""
    sites = sorted({k.split("/", 2)[2] for r in rows for k in r["summary"]
                    if k.startswith("eval/recovered/")})
    out = {}
    for site in sites:
        won = [r["seed"] for r in rows if r["summary"].get(f"eval/recovered/{site}") == 1]
        out[site] = {"recovered": len(won), "of": len(rows), "seeds": won}
    if sites:
        won = [r["seed"] for r in rows if r["summary"]
               and all(r["summary"].get(f"eval/recovered/{s}") == 1 for s in sites)]
        out["all"] = {"recovered": len(won), "of": len(rows), "seeds": won}
    return out


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float) and not v.is_integer():
        return f"{v:.4f}"
    return str(int(v)) if isinstance(v, (int, float)) else str(v)


def table(rows: list[dict]) -> str:
    """The per-seed table (a column per metric and site the summaries have), then the
    recovery rates."""
    keys = sorted({k for r in rows for k in r["summary"]},
                  key=lambda k: ([m for m, _ in METRICS].index(k.split("/")[1]), k))
    short = dict(METRICS)
    head = ["seed", "exit", *(f"{short[k.split('/')[1]]}/{k.split('/', 2)[2]}" for k in keys)]
    body = [[str(r["seed"]), str(r["exit"]) + (" (done before)" if r["skipped"] else ""),
             *(_cell(r["summary"].get(k)) for k in keys)] for r in rows]
    width = [max(len(line[i]) for line in [head, *body]) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(line, width)) for line in [head, *body]]
    for site, r in rates(rows).items():
        name = "all sites" if site == "all" else site
        lines.append(f"{name}: recovered at {r['recovered']} of {r['of']} seeds"
                     + (f" ({', '.join(map(str, r['seeds']))})" if r["seeds"] else ""))
    failed = [r["seed"] for r in rows if r["exit"] != 0]
    if failed:
        lines.append(f"failed (no summary): seeds {', '.join(map(str, failed))}; "
                     f"their logs are under {LOGS}/")
    return "\n".join(lines)


def main(args: list[str]) -> int:
    """`ppgd-tpu sweep` (see the module docstring); exit 0 when every seed's train exited
    0, 1 when one did not, 2 for a refused command line (nothing is run)."""
    named = cmdline.named(cmdline.join_values(args, ["config", *OWN_FLAGS]))
    if "seed" in named:
        raise cmdline.UsageError("--seed: the sweep gives each run its seed from --seeds")
    if "run_dir" in named:
        raise cmdline.UsageError("--run_dir: the sweep gives each run its run dir, DIR/seed_<s> "
                                 "(DIR: --output)")
    cfg, extra = cmdline.parse_config_args(args, {
        "seeds": ("", "seeds to run: 0-15, 0,3,7 or a mix (0-3,8)", parse_seeds),
        "jobs": ("1", "seeds trained at once (each its own process)", cmdline.count),
        "output": ("", "directory of the sweep's run dirs, logs and sweep.json "
                   "(default: runs/sweep-<config name>)")})
    out = extra["output"] or os.path.join("runs", f"sweep-{cfg.name}")
    if storage.is_gcs(out):
        raise cmdline.UsageError(f"--output: {out}: a sweep keeps its runs and logs on local disk")
    cmdline.output_path("output", out, directory=True)
    from ppgd_tpu.workspace import SUMMARY, RunDir

    seeds = extra["seeds"]
    run_dirs = {s: os.path.join(out, f"seed_{s}") for s in seeds}
    done = set()
    for s in seeds:  # a finished run must be this command's, as `train` would check
        rd = RunDir(run_dirs[s])
        if rd.complete:
            try:
                rd.check_compatible(dataclasses.replace(cfg, seed=s))
            except config_lib.ConfigError as e:
                raise cmdline.UsageError(
                    f"--output: {rd.path} holds seed {s}'s finished run of another config; "
                    "give another --output, or this sweep's original flags. "
                    + str(e).removeprefix("--run_dir: ")) from None
            done.add(s)
    train = _train_args(args)
    os.makedirs(os.path.join(out, LOGS), exist_ok=True)
    status, seconds = {}, {}
    for s in sorted(done):
        status[s] = 0
        print(f"seed {s}: already complete ({run_dirs[s]}/{SUMMARY}); not re-run", flush=True)
    todo = [s for s in seeds if s not in done]
    running: dict[int, tuple[subprocess.Popen, float, object]] = {}
    try:
        while todo or running:
            while todo and len(running) < extra["jobs"]:
                s = todo.pop(0)
                log = open(os.path.join(out, LOGS, f"seed_{s}.log"), "ab")
                cmd = [sys.executable, "-m", "ppgd_tpu.cli", "train", *train, f"--seed={s}",
                       f"--run_dir={run_dirs[s]}"]
                log.write(f"$ {' '.join(cmd)}\n".encode())
                log.flush()
                running[s] = (subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL), time.time(), log)
                print(f"seed {s}: training in {run_dirs[s]} (log: "
                      f"{os.path.join(out, LOGS, f'seed_{s}.log')})", flush=True)
            time.sleep(0.2)
            for s, (proc, start, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[s]
                status[s], seconds[s] = proc.returncode, time.time() - start
                print(f"seed {s}: exit {proc.returncode} after {seconds[s]:.0f} s", flush=True)
    finally:  # a signal (or an error here): stop the children as SIGTERM stops a run [C5]
        for proc, _, log in running.values():
            proc.terminate()
        for proc, _, log in running.values():
            proc.wait()
            log.close()
    rows = []
    for s in seeds:
        rd = RunDir(run_dirs[s])
        summary = summary_row(rd.read_summary()) if status[s] == 0 and rd.complete else {}
        if status[s] == 0 and not summary and not rd.complete:
            status[s] = "no summary"  # exit 0 without summary.json: not a result
        rows.append({"seed": s, "run_dir": run_dirs[s], "exit": status[s],
                     "skipped": s in done, "seconds": seconds.get(s), "summary": summary})
    print(table(rows))
    storage.write_bytes(os.path.join(out, RESULT), json.dumps(
        {"config": cfg.name, "train_args": train, "seeds": seeds, "rows": rows,
         "rates": rates(rows)}, indent=1).encode())
    print(f"wrote {os.path.join(out, RESULT)}")
    return 0 if all(r["exit"] == 0 for r in rows) else 1
