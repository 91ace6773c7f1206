"""The consumer API: `ppgd_tpu.load_decomposition`, a run's components as numpy, and
`ppgd_tpu.load_run`, the same together with its CI function, so a researcher can ask which
components an input of their own uses.

The CI function is the other half of a decomposition [S5]: it is restored here from a
committed checkpoint's `decomposition` part [C2], with the frozen target rebuilt from the
run's config and checked against the weights the run was started with [C1]. Host numpy in,
host numpy out; no mesh, one process.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable

import jax
import numpy as np
from safetensors import numpy as safetensors_numpy

from ppgd_tpu import checkpoint, resume, storage
from ppgd_tpu.config import Config
from ppgd_tpu.data import lm as data_lib
from ppgd_tpu.step import Decomposer, TrainState
from ppgd_tpu.targets import build as target_build
from ppgd_tpu.targets.base import Target
from ppgd_tpu.workspace import DECOMPOSITION, RunDir


@dataclasses.dataclass(frozen=True)
class Run:
    """A run's state at one committed step. `components`: {site: {"V": [d_in, C],
    "U": [C, d_out]}}, as `load_decomposition` gives them; `ci(inputs)`: the CI."""

    path: str
    config: Config
    step: int
    target: Target
    components: dict[str, dict[str, np.ndarray]]
    _lower: Callable  # jitted (ci_fn, components, target, inputs) -> {site: lower CI}
    _state: tuple  # (ci_fn, components) as the CI function reads them

    def ci(self, inputs) -> dict[str, np.ndarray]:
        """The causal importance (`lower`, in [0, 1]: what the masks use [S5, S6]) of every
        component on `inputs`: {site: [*leading, C]}. Inputs are what the target reads: toys
        [B, n_features] floats (leading [B]); LMs [B, T] token ids (leading [B, T])."""
        x = np.asarray(inputs)
        n = self.target.n_features
        if n is not None and (x.ndim != 2 or x.shape[1] != n):
            raise ValueError(f"inputs: expected [batch, {n}] (this target's n_features), "
                             f"got shape {x.shape}")
        if n is None:
            t_max = self.config.target.llama_simple_mlp.max_seq_len
            vocab = self.config.target.llama_simple_mlp.vocab_size
            if x.ndim != 2 or not 1 <= x.shape[1] <= t_max:
                raise ValueError(f"inputs: expected [batch, T] token ids with 1 <= T <= "
                                 f"{t_max} (max_seq_len), got shape {x.shape}")
            if not np.issubdtype(x.dtype, np.integer) or x.min() < 0 or x.max() >= vocab:
                raise ValueError(f"inputs: expected integer token ids in [0, {vocab})")
        x = x.astype(np.int32 if n is None else np.float32)
        ci_fn, comps = self._state
        lower = self._lower(ci_fn, comps, self.target, x)
        return {s: np.asarray(v) for s, v in lower.items()}


def load_run(run_dir: str, step: int | None = None) -> Run:
    """The run in `run_dir` at its committed checkpoint `step` (default: the latest, which
    for a finished run is its final state). For an LM the config's `target.path` must still
    hold the weights the run was started with."""
    rd = RunDir(run_dir)
    if not rd.exists:
        raise FileNotFoundError(f"{rd.path}: no run there (no config.yaml)")
    committed = checkpoint.committed_steps(rd.path)
    if not committed:
        raise FileNotFoundError(f"{rd.path}: no committed checkpoint yet")
    if step is None:
        step = committed[-1]
    elif isinstance(step, bool) or not isinstance(step, (int, np.integer)):
        raise TypeError(f"step: expected an int (a committed step) or None, got {step!r}")
    step = int(step)
    if step not in committed:
        raise ValueError(f"step: {step} is not a committed checkpoint of {rd.path}; its "
                         f"committed steps: {', '.join(map(str, committed))}")
    cfg = rd.stored_config()
    target = target_build.build(cfg.target)
    rd.check_inputs(cfg, target_build.fingerprint(target, cfg.target), None)
    dec = Decomposer(cfg, target, data_lib.batch_shape(cfg, target))
    arrays = checkpoint.restore(rd.path, step, parts=("decomposition",)).arrays
    try:
        fields = resume.restore_fields(dec, target, arrays, ("components", "ci_fn"))
    except checkpoint.DamagedCheckpoint as e:
        raise checkpoint.damaged(rd.path, step, e) from None
    comps = fields["components"]
    numpy = {s: {"V": np.asarray(comps.V[s]), "U": np.asarray(comps.U[s])} for s in dec.sites}
    lower = jax.jit(lambda ci_fn, comps, t, x: dec.ci(ci_fn, comps, t, x).lower)
    return Run(storage.normalize(rd.path), cfg, step, target, numpy, lower,
               (fields["ci_fn"], comps))


def save_decomposition(path: str, state: TrainState, sites) -> None:
    """A finished run's components, as `load_decomposition` reads them first."""
    comps = jax.device_get(state.components)
    tensors = {}
    for s in sites:
        tensors[f"{s}/V"] = np.asarray(comps.V[s])
        tensors[f"{s}/U"] = np.asarray(comps.U[s])
    storage.write_bytes(path, safetensors_numpy.save(
        tensors, metadata={"sites": json.dumps(list(sites))}))


def load_decomposition(run_dir: str) -> dict[str, dict[str, np.ndarray]]:
    """The consumer API: components as numpy, {site: {"V": [d_in, C], "U": [C, d_out]}}.

    A finished run's decomposition.safetensors; for a run still going (or stopped), the
    `decomposition` part of its latest committed checkpoint [C2] (no mesh needed), with a
    warning that names its step: those are not the final components.
    """
    run_dir = storage.normalize(run_dir)  # a pathlib.Path, `~`
    if not storage.exists(run_dir):
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    if not storage.is_dir(run_dir):
        raise NotADirectoryError(f"{run_dir} is a file, not a run directory")
    rd = RunDir(run_dir)
    path = rd.file(DECOMPOSITION)
    out: dict[str, dict[str, np.ndarray]] = {}
    if storage.exists(path):
        blob = storage.read_bytes(path)
        try:
            tensors = safetensors_numpy.load(blob)
        except Exception as e:  # safetensors raises several types for a damaged file
            raise ValueError(f"{path} is not a readable safetensors file ({e}); the run's "
                             "latest checkpoint holds the same components: delete the file "
                             "to read them from there") from None
        for name, arr in tensors.items():
            site, part = name.rsplit("/", 1)
            out.setdefault(site, {})[part] = arr
        return out
    step = checkpoint.latest_step(run_dir)
    if step is None:
        raise FileNotFoundError(f"{run_dir}: no decomposition yet ({DECOMPOSITION} missing and "
                                "no committed checkpoint)")
    if not rd.complete:  # (a finished run's last checkpoint is its final state)
        warnings.warn(f"{run_dir} has not finished: these are the components of its "
                      f"checkpoint at step {step}, not the final ones", stacklevel=2)
    arrays = checkpoint.restore(run_dir, step, parts=("decomposition",)).arrays
    prefix = "decomposition/components/"
    for name, arr in arrays.items():
        if name.startswith(prefix):
            part, site = name[len(prefix):].split("/", 1)
            out.setdefault(site, {})[part] = np.asarray(arr)
    return out
