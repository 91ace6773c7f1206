"""The report's static site: data as JavaScript files beside fixed HTML/JS/CSS assets.

Layout of a report dir (everything relative, no network: it opens from the file system,
where a page may load scripts but not fetch JSON):

  index.html, component.html, report.js, report.css   the assets (ppgd_tpu/report/assets)
  data/run.js        `window.REPORT = {...}`: the run (config, step, metrics, curves) and,
                     per site, one row per alive component (the tables)
  data/site_<i>.js   `window.REPORT_SITE = {...}`: per alive component of site i its CI
                     histogram, co-activations, and for LMs its top contexts, for toys its
                     CI on the one-hot inputs and its weights (component.html?site=i&c=c)
  figures/*.png      the run's own figures, when the report is of its final step
  report.json        what was reported (run, step, rows, top_k), written last: a dir
                     holding it is a report this package wrote

`write` builds the dir beside its destination and renames it into place (a local one), so
a reader never sees half a report and a failed build leaves the old one; gs:// has no
rename, so there the files are uploaded one by one, report.json last.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from importlib import resources

import numpy as np

from ppgd_tpu import storage
from ppgd_tpu.config import ConfigError

ASSETS = ("index.html", "component.html", "report.js", "report.css")
MARKER = "report.json"
COACT_SHOWN = 8  # co-activating components listed per component
CURVE_POINTS = 1000  # at most this many records per curve (evenly strided)


def check_output(out: str) -> None:
    """`out` may receive a report: new, empty, or a report written before (its MARKER);
    anything else would be replaced by it: refused naming --output."""
    try:
        storage.check_creatable(out, directory=True)
    except ValueError as e:
        raise ConfigError(f"--output: {e}") from None
    if storage.exists(out) and storage.list_entries(out) and not storage.exists(
            storage.join(out, MARKER)):
        raise ConfigError(f"--output: {out} holds files but no {MARKER}, so it is not a report "
                          "this command wrote (it would be replaced); give a new or empty dir")


def _finite(x) -> float | None:
    x = float(x)
    return x if np.isfinite(x) else None


def _token_text(decode, token: int) -> str:
    return "" if token < 0 else decode(token)


def site_tables(scan, sites: tuple[str, ...], components: dict, onehot: dict | None,
                threshold: float) -> list[dict]:
    """Per site (in `sites`' order, the run's) its table: one row per alive component (count > 0):
    index c, activation density, mean CI, |V_c| |U_c|, the components it co-activates with
    most (P(d on | c on)), and for a toy the one-hot features that turn it on."""
    out = []
    for i, s in enumerate(sites):
        st = scan.stats[s]
        V, U = components[s]["V"], components[s]["U"]
        norm = np.linalg.norm(V, axis=0) * np.linalg.norm(U, axis=1)
        count = np.asarray(st.count)
        rows = []
        for c in np.flatnonzero(count > 0):
            together = np.asarray(st.coact[c], np.float64) / count[c]
            together[c] = 0.0
            best = [d for d in np.argsort(-together, kind="stable")[:COACT_SHOWN]
                    if together[d] > 0]
            row = {"c": int(c), "density": float(count[c] / scan.n_positions),
                   "mean_ci": float(st.total[c] / scan.n_positions), "norm": _finite(norm[c]),
                   "coact": [[int(d), float(together[d])] for d in best]}
            if onehot is not None:
                row["features"] = [int(f) for f in np.flatnonzero(onehot[s][:, c] > threshold)]
            rows.append(row)
        out.append({"name": s, "index": i, "C": int(len(count)), "d_in": int(V.shape[0]),
                    "d_out": int(U.shape[1]), "n_alive": len(rows),
                    "file": f"data/site_{i}.js", "components": rows})
    return out


def site_details(scan, site: str, components: dict, onehot: dict | None,
                 decode) -> dict:
    """A site's per-component page data (alive components only): histogram counts, and
    for an LM its top contexts (most CI first; each its store row, position, window tokens
    decoded one by one and that component's CI on each), for a toy its CI on each one-hot
    input and its weights V[:, c], U[c, :]."""
    st = scan.stats[site]
    out = {}
    for c in np.flatnonzero(np.asarray(st.count) > 0):
        page = {"hist": [int(n) for n in st.hist[c]]}
        if st.top_ci is not None:
            page["contexts"] = [
                {"ci": float(st.top_ci[c, k]), "row": int(scan.row_ids[st.top_row[c, k]]),
                 "pos": int(st.top_pos[c, k]),
                 "tokens": [_token_text(decode, int(t)) for t in st.window_tokens[c, k]],
                 "cis": [round(float(v), 4) for v in st.window_ci[c, k]]}
                for k in range(st.top_ci.shape[1]) if st.top_ci[c, k] >= 0]
        if onehot is not None:
            page["onehot"] = [round(float(v), 4) for v in onehot[site][:, c]]
            page["V"] = [float(v) for v in components[site]["V"][:, c]]
            page["U"] = [float(v) for v in components[site]["U"][c]]
        out[str(int(c))] = page
    return out


def curves(records: list[dict], upto: int) -> dict:
    """{key: [[step, value], ...]} of every number logged at steps <= `upto` (at most
    CURVE_POINTS records, evenly strided, the last kept), without the per-window
    statistics of the grad norms."""
    records = [r for r in records if r["step"] <= upto]
    if len(records) > CURVE_POINTS:
        stride = -(-len(records) // CURVE_POINTS)
        records = records[::stride] + ([records[-1]] if (len(records) - 1) % stride else [])
    out: dict[str, list] = {}
    for r in records:
        for k, v in r.items():
            if (k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
                    and not k.endswith(("/min", "/median", "/max"))):
                out.setdefault(k, []).append([r["step"], v])
    return out


def _script(name: str, value) -> bytes:
    return (f"window.{name} = " + json.dumps(value, allow_nan=False, separators=(",", ":"))
            + ";\n").encode()


def write(out: str, report: dict, details: list[dict], figures: dict[str, bytes]) -> None:
    """The site (module docstring) into `out`, whole or not at all (local), from the
    tables and overview `report`, each site's `details` and the PNG `figures` by name."""
    files = {f"data/site_{i}.js": _script("REPORT_SITE", d) for i, d in enumerate(details)}
    files["data/run.js"] = _script("REPORT", report)
    for name, data in figures.items():
        files[f"figures/{name}"] = data
    assets = resources.files("ppgd_tpu.report") / "assets"
    for name in ASSETS:
        files[name] = (assets / name).read_bytes()
    marker = json.dumps({"run": report["run"], "step": report["step"], "rows": report["rows"],
                         "top_k": report["top_k"], "written": report["generated"]},
                        indent=1).encode()
    if storage.is_gcs(out):
        for name, data in files.items():
            storage.write_bytes(storage.join(out, name), data)
        storage.write_bytes(storage.join(out, MARKER), marker)
        return
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    build = tempfile.mkdtemp(prefix=os.path.basename(out) + ".tmp-", dir=parent)
    try:
        for name, data in {**files, MARKER: marker}.items():
            os.makedirs(os.path.dirname(os.path.join(build, name)), exist_ok=True)
            with open(os.path.join(build, name), "wb") as fh:
                fh.write(data)
        os.chmod(build, 0o755)
        old = None
        if os.path.exists(out):  # a report written before: replaced once this one is whole
            old = tempfile.mkdtemp(prefix=os.path.basename(out) + ".old-", dir=parent)
            os.replace(out, os.path.join(old, "report"))
        os.replace(build, out)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(build, ignore_errors=True)
        raise


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
