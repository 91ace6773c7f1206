"""`ppgd-tpu report --run_dir R [--step N] [--output DIR] [--rows N] [--top_k K]`: a static
site showing what each component of a run's committed checkpoint does (site.py has its
layout; scan.py the statistics).

Like `ppgd-tpu eval` it only reads the run (no lock: a run still training can be reported)
and runs under the run's own config on this machine's mesh, every process scanning its own
rows; process 0 writes the site, by default to R/report/step_<N>. A refused input (no run,
a step that is not committed, a count < 1, an --output that is not a report) exits 2
naming the flag, before any compute and writing nothing.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from ppgd_tpu import cmdline, storage
from ppgd_tpu.config import ConfigError, dump_yaml

REPORT = "report"  # RUN_DIR/report/step_<N>: the default output
DEFAULT_LM_ROWS = 256
DEFAULT_TOY_ROWS = 16384
DEFAULT_TOP_K = 20


USAGE = ("usage: ppgd-tpu report --run_dir R [--step N] [--output DIR] [--rows N] [--top_k K]\n\n"
         "Write a static site (index.html) showing what each component of a run does: per "
         "site a table of its alive components, per component its top contexts (LMs) or "
         "one-hot CI and weights (toys). Reads the run only.")
FLAGS = {
    "run_dir": (None, "the run (local or gs://)"),
    "step": ("", "a committed checkpoint's step (default: the latest)",
             cmdline.optional(cmdline.count)),
    "output": ("", "the site's directory, local or gs:// (default: RUN_DIR/report/step_<N>)"),
    "rows": ("", f"rows to scan: an LM's first rows of its store, held out when "
                 f"data.eval_rows covers them (default {DEFAULT_LM_ROWS}, at most the held-out "
                 f"rows); a toy's draws (default {DEFAULT_TOY_ROWS})",
             cmdline.optional(cmdline.count)),
    "top_k": (str(DEFAULT_TOP_K), "LMs: contexts shown per component", cmdline.count),
}


def _decoder(store):
    """Token id -> its text, from the store's tokenizer (`byte`, or its tokenizer.json when
    that file is still where tokenize read it and means the same ids); else `<id>`."""
    from ppgd_tpu.data import tokenize

    name, known = store.meta.get("tokenizer"), store.tokenizer_id
    tok = None
    if name == "byte":
        tok = tokenize.ByteTokenizer()
    elif name and known and storage.exists(name):
        try:
            tok = tokenize.HFTokenizer(name)
        except tokenize.TokenizeError:
            tok = None
        if tok is not None and tok.id != known:
            tok = None
    if tok is None:
        return lambda t: f"<{t}>"
    eos = store.eos_id
    return lambda t: "<eos>" if t == eos else (tok.decode(np.asarray([t])) or f"<{t}>")


def _records(rd) -> list[dict]:
    from ppgd_tpu import metrics

    path = rd.file(metrics.METRICS)
    if not storage.exists(path):
        return []
    return [r for _, r in metrics.records(path, storage.read_bytes(path))]


def _metrics_at(rd, step: int, records: list[dict]) -> tuple[dict, str | None]:
    """The run's evaluation of `step`: summary.json when it is of that step, else that
    step's eval line of metrics.jsonl, else none."""
    if rd.complete:
        summary = rd.read_summary()
        if summary.get("step") == step:
            return {k: v for k, v in summary.items() if k != "step"}, "summary.json"
    evals = [r for r in records if r["step"] == step and any(k.startswith("eval/") for k in r)]
    if evals:
        return {k: v for k, v in evals[-1].items() if k.startswith("eval/")}, \
            f"metrics.jsonl (the eval at step {step})"
    return {}, None


def _row_source(cfg) -> str:
    """Which rows an LM report scanned (scan.lm_row_count keeps them in the held-out ones)."""
    return f"the first rows of {cfg.data.store} " + (
        "(held out: data.eval_rows)" if cfg.data.eval_rows else
        "(none held out: data.eval_rows is 0)")


def build(rd, cfg, step: int, trainer, state, n_rows: int, top_k: int, progress: bool,
          out: str) -> dict:
    """Scans, then (process 0) writes the site to `out`; returns its REPORT overview."""
    from ppgd_tpu import dist
    from ppgd_tpu.report import scan as scan_lib
    from ppgd_tpu.report import site

    began = time.perf_counter()
    result = scan_lib.scan(trainer, state, n_rows, top_k, progress)
    comps = trainer.to_host(state.components)
    components = {s: {"V": np.asarray(comps.V[s]), "U": np.asarray(comps.U[s])}
                  for s in trainer.dec.sites}
    onehot = None
    if trainer.target.n_features is not None:
        onehot = {s: np.asarray(v) for s, v in
                  trainer.to_host(trainer.programs.one_hot(state, trainer.target)).items()}
    if not dist.is_main():
        return {}
    lm = trainer.target.n_features is None
    decode = _decoder(trainer.data.store) if lm else None
    threshold = cfg.eval.ci_alive_threshold
    records = _records(rd)
    metrics, source = _metrics_at(rd, step, records)
    figures = {}
    if rd.complete and step == cfg.decomp.steps:  # the run's figures are of its final step
        folder = rd.file("figures")
        for name in sorted(storage.list_files(folder) if storage.exists(folder) else ()):
            if name.endswith(".png"):
                figures[name] = storage.read_bytes(storage.join(folder, name))
    report = {
        "run": rd.path, "name": cfg.name, "step": step, "steps": cfg.decomp.steps,
        "complete": rd.complete, "kind": "lm" if lm else "toy", "target": cfg.target.kind,
        "threshold": threshold, "rows": n_rows, "positions": result.n_positions,
        "top_k": top_k if lm else None, "context_before": scan_lib.CONTEXT_BEFORE,
        "generated": site.now(),
        "row_source": _row_source(cfg) if lm
                      else "draws from the toy's data distribution",
        "config": dump_yaml(cfg), "metrics": metrics, "metrics_source": source,
        "curves": site.curves(records, step), "figures": sorted(figures),
        "sites": site.site_tables(result, trainer.dec.sites, components, onehot, threshold),
    }
    details = [site.site_details(result, s, components, onehot, decode)
               for s in trainer.dec.sites]
    site.write(out, report, details, figures)
    alive = ", ".join(f"{t['name']} {t['n_alive']}/{t['C']}" for t in report["sites"])
    print(f"report of step {step} of {rd.path} ({n_rows} rows, "
          f"{time.perf_counter() - began:.1f} s): {storage.join(out, 'index.html')}\n"
          f"  alive components: {alive}")
    return report


def main(argv: list[str]) -> int:
    """`ppgd-tpu report ARGS` (argv without the program and command names)."""
    args, positional = cmdline.parse_flags(argv, FLAGS, USAGE)
    if positional:
        raise cmdline.UsageError(f"{' '.join(positional)!r}: report takes flags only "
                                 "(--run_dir R ...)")
    from ppgd_tpu import dist
    from ppgd_tpu.workspace import RunDir

    rd = RunDir(args["run_dir"])
    if not rd.exists:
        raise ConfigError(f"--run_dir: {rd.path} holds no run (no config.yaml)")
    cfg = rd.stored_config()
    dist.initialize()
    from ppgd_tpu import engine
    from ppgd_tpu.report import scan as scan_lib
    from ppgd_tpu.report import site

    step = engine.committed_step(rd, args["step"])
    out = storage.normalize(args["output"] or storage.join(rd.path, REPORT, f"step_{step}"))
    site.check_output(out)
    trainer, state = engine.restore_committed(cfg, rd, step)
    if trainer.target.n_features is None:
        store = trainer.data.store
        n_rows = scan_lib.lm_row_count(args["rows"], store.n_rows, cfg.data.eval_rows,
                                       DEFAULT_LM_ROWS)
    else:
        n_rows = args["rows"] or DEFAULT_TOY_ROWS
    build(rd, cfg, step, trainer, state, n_rows, args["top_k"],
          cfg.log.progress and sys.stderr.isatty(), out)
    return 0
