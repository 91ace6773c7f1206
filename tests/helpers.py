"""What many test modules need, written once: trees compared leaf by leaf, a config from
dotted overrides, a `ppgd-tpu` command run in this process with its exit status and output."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ppgd_tpu import cli
from ppgd_tpu import config as config_lib


def leaves(tree) -> list[np.ndarray]:
    """The leaves of a pytree (arrays, scalars) as host numpy arrays, in tree order."""
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def max_rel(want, got) -> float:
    """max |got - want| / max |want|: the error relative to the array's scale (an exact 0
    stays 0; a zero `want` is compared absolutely)."""
    a, b = np.asarray(want, np.float64), np.asarray(got, np.float64)
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(a), initial=0.0), 1e-12))


def assert_same(actual, desired, *, rtol: float = 0.0, atol: float = 0.0,
                what: str = "") -> None:
    """`actual` has as many leaves as `desired` and each equals desired's: bit for bit (no
    tolerance given), or elementwise within `rtol`/`atol` of desired's values
    (np.testing.assert_allclose). A failure names the leaf's index and `what`."""
    for i, (x, y) in enumerate(zip(leaves(actual), leaves(desired), strict=True)):
        where = f"{what} leaf {i}".strip()
        if rtol or atol:
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=where)
        else:
            np.testing.assert_array_equal(x, y, err_msg=where)


def config(overrides: dict[str, Any], base: config_lib.Config | None = None
           ) -> config_lib.Config:
    """`base` (default: the schema's defaults, Config()) with {dotted.path: value}
    overrides, as the flags `--dotted.path=value` give them: a path may name a mapping's new
    entry (`decomp.sites.*`, `loss.persistent_pgd.ppgd.coeff`; its other fields at their
    defaults); values typed and the result validated as a command line's are."""
    base = config_lib.Config() if base is None else base
    with_entries = config_lib.with_entries(base, {p: str(v) for p, v in overrides.items()})
    return config_lib.with_overrides(with_entries, overrides)


def run_command(argv: list[str], capsys) -> tuple[int, str, str]:
    """`ppgd-tpu ARGV` in this process (cli.run: the dispatch and the refusals' exit 2, not
    the process setup of cli.main) -> (exit status, stdout, stderr)."""
    rc = cli.run(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err
