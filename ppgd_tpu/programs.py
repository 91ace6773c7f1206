"""Every jitted program of a run on its mesh, built from shapes.

`Programs(cfg, placement, target, batches)` jits the step variants (replay.py), the placed
init and faithfulness warmup [S21, R1] and the evals with explicit shardings from the ONE
rule table (mesh.py) and the run's donation, each traced for the run's mesh (tracing.py).
`run_templates` names every leaf of a run with the logical axes its module declares
(axes.py): what those shardings, `ppgd-tpu shardings` and a restore place.
Nothing here reads data, weights or JAX's device list: `target` may hold arrays (`train`)
or only their shapes (`ppgd-tpu compile`, over a TPU topology's devices), and both get the
same programs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from ppgd_tpu import axes, resume, tracing
from ppgd_tpu import eval as eval_lib
from ppgd_tpu import mesh as mesh_lib
from ppgd_tpu.config import Config
from ppgd_tpu.replay import ReplayController, Shardings, Window, window_template
from ppgd_tpu.step import Decomposer


class Batches(NamedTuple):
    """Shapes and dtypes of a run's inputs: the training batch, the eval batch and (LMs)
    its next-token labels."""

    train: jax.ShapeDtypeStruct
    eval: jax.ShapeDtypeStruct
    eval_labels: jax.ShapeDtypeStruct | None


class Programs:
    """The run's static description (`dec`), its shardings and its jitted programs:
    `replay` (the step variants), `init`, `warmup_optimizer_state`, `warmup_part`,
    `fast_eval`, `one_hot` (toys with known features) and `gather` (a tree replicated)."""

    def __init__(self, cfg: Config, placement: mesh_lib.Placement, target, batches: Batches):
        self.cfg, self.placement, self.batches = cfg, placement, batches
        mesh = placement.mesh
        self.dec = dec = Decomposer(cfg, target, batches.train.shape)
        self.shardings = sh = step_shardings(placement, dec, target, batches.train,
                                             window_template(dec, target, batches.train))
        self.replay = ReplayController(dec, sh)
        st, rep = sh.state, placement.replicated

        def jit(fn, **kw):
            return jax.jit(tracing.traced_on(mesh, fn), **kw)

        self.init = jit(dec.init, in_shardings=(sh.target,), out_shardings=st)
        # the warmup's AdamW has the main one's structure: placed as opt_components is
        self.warmup_optimizer_state = jit(dec.warmup_optimizer_state, in_shardings=(st,),
                                          out_shardings=st.opt_components)
        self.warmup_part = jit(dec.faithfulness_warmup_part, donate_argnums=(0, 1),
                               out_shardings=(st, st.opt_components))
        rows = lambda b: None if b is None else placement.sharding("batch", b.shape,
                                                                    target.input_axes)
        self.fast_eval = jit(lambda s, t, x, y: eval_lib.fast_metrics(dec, s, t, x, y),
                             in_shardings=(st, sh.target, rows(batches.eval),
                                           rows(batches.eval_labels)),
                             out_shardings=rep)
        self.one_hot = jit(lambda s, t: eval_lib.one_hot_ci(dec, s, t),
                           in_shardings=(st, sh.target), out_shardings=rep)
        self.gather = jax.jit(lambda tree: tree, out_shardings=rep)


def run_templates(dec, target, batch: jax.ShapeDtypeStruct, window: Window,
                  metrics: bool = True) -> tuple[dict, dict]:
    """Shapes and declared logical axes of every step input/output: ({group: {leaf name:
    Leaf}}, {"state": the abstract train state}). Groups: the train state (checkpoint
    names), the frozen target, the batch, each field of the replay window `window`
    (replay.Window, abstract; its None fields absent; the kept V placed as the components'
    V) and (`metrics`) the step metrics, replicated scalars, which take a trace of the whole
    step to name (~1.5 s): the steps need none."""
    state = jax.eval_shape(dec.init, target)
    state_axes = axes.of(state, dec.opt)

    def group(tree, tree_axes, prefix):
        return mesh_lib.with_axes(resume.named_leaves(tree, prefix),
                                  resume.named_leaves(tree_axes, prefix))

    named = {
        "state": mesh_lib.with_axes(resume.state_leaves(state), resume.state_leaves(state_axes)),
        "target": group(target, axes.of(target), "target"),
        "batch": {"batch": mesh_lib.Leaf(batch, target.input_axes)},
    }
    for field, tree in window._asdict().items():
        if tree is not None:
            tree_axes = state_axes.components.V if field == "envelope_V" else axes.of(tree)
            named[field] = group(tree, tree_axes, f"{resume.WINDOW}/{field}")
    if metrics:
        named["metrics"] = {f"metrics/{k}": mesh_lib.Leaf(v, axes.Axes()) for k, v in
                            jax.eval_shape(dec.full, state, target, batch)[1].items()}
    return named, {"state": state}


def step_shardings(placement: mesh_lib.Placement, dec, target, batch: jax.ShapeDtypeStruct,
                   window: Window) -> Shardings:
    """replay.Shardings of a run: what every step variant is jitted with; `window` the
    abstract replay window with every field (replay.window_template)."""
    named, trees = run_templates(dec, target, batch, window, metrics=False)
    for group in ("accumulator", "envelope_V"):  # every leaf placed, even the ones sharing
        placement.names(named.get(group, {}))  # a sharding
    return Shardings(state=placement.tree(trees["state"], named["state"]),
                     target=placement.tree(target, named["target"]),
                     batch=placement.names(named["batch"])["batch"],
                     env=placement.tree(window.envelope, named["envelope"]),
                     scalar=placement.replicated)
