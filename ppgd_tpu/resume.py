"""What a checkpoint holds and how the loop gets it back [C1, C2, W6].

The train state is flattened to named leaves: `decomposition/...` holds V/U and the CI fn
(what consumers load), `training/...` everything else (both optimizer states, every
adversary, the step). A mid-window checkpoint adds the fields of the replay window that a
restore cannot rebuild bit for bit (`replay.Policy.stored`: the table in replay.py), as
`training/replay/<field>/...`.

So resuming at any step continues the uninterrupted trajectory exactly [C3]. The frozen
target and the data position are not stored: the batch is a pure function of (seed, s // k).
"""

from __future__ import annotations

import dataclasses

import jax

from ppgd_tpu.checkpoint.manifest import DamagedCheckpoint, Manifest
from ppgd_tpu.replay import ReplayController
from ppgd_tpu.step import Decomposer, TrainState

STATE_FIELDS = tuple(f.name for f in dataclasses.fields(TrainState))  # its flatten order
DECOMPOSITION_FIELDS = ("components", "ci_fn")
WINDOW = "training/replay"  # where a mid-window checkpoint keeps the replay window's state


def _key_name(k) -> str:
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def named_leaves(tree, prefix: str) -> dict[str, jax.Array]:
    """{prefix/path/of/leaf: leaf} with path segments from attribute names and dict keys."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {"/".join([prefix, *(_key_name(k) for k in path)]): leaf for path, leaf in flat}


def _state_prefix(field: str) -> str:
    part = "decomposition" if field in DECOMPOSITION_FIELDS else "training"
    return f"{part}/{field}"


def state_leaves(state: TrainState) -> dict[str, jax.Array]:
    """{checkpoint name: leaf} of the train state, in the state's flatten order."""
    out = {}
    for field in STATE_FIELDS:
        out.update(named_leaves(getattr(state, field), _state_prefix(field)))
    return out


def checkpoint_leaves(state: TrainState, replay: ReplayController) -> dict[str, jax.Array]:
    """Every leaf a checkpoint at this point of the loop must hold [C1, W6]."""
    out = state_leaves(state)
    if int(state.step) % replay.k == 0:  # a window boundary: nothing of the window survives
        return out
    out.update(named_leaves(replay.saved(), WINDOW))
    return out


def _fill(template, arrays: dict, prefix: str):
    names = list(named_leaves(template, prefix))
    missing = [n for n in names if n not in arrays]
    if missing:
        raise DamagedCheckpoint(f"it lacks {len(missing)} leaves of this run's state, e.g. "
                                f"{missing[:3]}")
    treedef = jax.tree.structure(template)
    return jax.tree.unflatten(treedef, [jax.numpy.asarray(arrays[n]) for n in names])


def log_window(manifest: Manifest) -> list[dict]:
    """The log window's statistics a checkpoint between log steps carried (window_carry)."""
    window = manifest.meta.get("log_window", [])
    if not (isinstance(window, list) and all(
            isinstance(m, dict) and all(isinstance(v, int | float) for v in m.values())
            for m in window)):
        raise DamagedCheckpoint("its manifest's meta.log_window is not a list of metric "
                                "records")
    return window


def restore_fields(dec: Decomposer, target, arrays: dict, fields: tuple[str, ...]) -> dict:
    """{field: that TrainState field of `arrays`} (host numpy from checkpoint.restore),
    shaped like init's."""
    template = jax.eval_shape(dec.init, target)
    return {f: _fill(getattr(template, f), arrays, _state_prefix(f)) for f in fields}


def restore_state(dec: Decomposer, target, arrays: dict) -> TrainState:
    """The TrainState of `arrays` (host numpy from checkpoint.restore), shaped like init."""
    return TrainState(**restore_fields(dec, target, arrays, STATE_FIELDS))


def restore_window(replay: ReplayController, dec: Decomposer, state: TrainState, target,
                   batch, arrays: dict) -> None:
    """Rebuilds the replay window at a mid-window step exactly [W6]: the controller gets
    what the checkpoint stored of it and rebuilds the rest."""
    stored = _fill(replay.stored_template(dec, target, batch), arrays, WINDOW)
    replay.resume(state, target, batch, stored)
