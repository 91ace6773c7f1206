"""The package's shape: its import layers (pyproject.toml's [tool.importlinter] contract,
checked by `lint-imports`) and README's layout table against the tree."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_imports_follow_the_layers_contract():
    """No import cycle between layers and no upward import: a module imports only from the
    layers below its own, and every module of the package is given a layer."""
    lint = Path(sys.executable).with_name("lint-imports")
    p = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-2000:]
    assert "Contracts: 1 kept, 0 broken." in p.stdout


def _layout_paths() -> list[str]:
    """The paths README's "Layout" table names: its first column's `a/b.py`, `c.py` entries,
    a later one in the first one's directory."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    paths = []
    for row in re.findall(r"^\| (`[^|]*`) \|", section, re.M):
        names = re.findall(r"`([^`]+)`", row)
        head = os.path.dirname(names[0].rstrip("/"))
        paths += [names[0]] + [os.path.join(head, n) for n in names[1:]]
    return paths


def test_readme_layout_table_matches_the_tree():
    """Every path the table names exists, and every module and package of ppgd_tpu/ (and
    every top-level directory of the repository) is named."""
    paths = _layout_paths()
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"README's layout names paths that do not exist: {missing}"
    named = {p.rstrip("/") for p in paths}
    package = {f"ppgd_tpu/{e.name}" for e in (ROOT / "ppgd_tpu").iterdir()
               if e.suffix == ".py" or (e / "__init__.py").exists()}
    top = {e.name for e in ROOT.iterdir() if e.is_dir() and not e.name.startswith(".")
           and not e.name.endswith(".egg-info")} - {"ppgd_tpu"}
    unnamed = sorted(p for p in package | top
                     if p not in named and not any(n.startswith(p + "/") for n in named))
    assert not unnamed, f"README's layout table does not name {unnamed}"
