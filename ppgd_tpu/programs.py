"""Every jitted program of a run on its mesh, built from shapes.

`Programs(cfg, placement, target, batches)` jits the step variants (replay.py), the placed
init and faithfulness warmup [S21, R1] and the evals with explicit shardings from the ONE
rule table (mesh.py) and the run's donation, each traced for the run's mesh (tracing.py).
Nothing here reads data, weights or JAX's device list: `target` may hold arrays (`train`)
or only their shapes (`ppgd-tpu compile`, over a TPU topology's devices), and both get the
same programs.
"""

from __future__ import annotations

from typing import NamedTuple

import jax

from ppgd_tpu import eval as eval_lib
from ppgd_tpu import mesh as mesh_lib
from ppgd_tpu import tracing
from ppgd_tpu.config import Config
from ppgd_tpu.replay import ReplayController, window_template
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
        self.shardings = sh = mesh_lib.step_shardings(
            placement, dec, target, batches.train,
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
        rows = lambda b: None if b is None else placement.sharding("batch", b.shape)
        self.fast_eval = jit(lambda s, t, x, y: eval_lib.fast_metrics(dec, s, t, x, y),
                             in_shardings=(st, sh.target, rows(batches.eval),
                                           rows(batches.eval_labels)),
                             out_shardings=rep)
        self.one_hot = jit(lambda s, t: eval_lib.one_hot_ci(dec, s, t),
                           in_shardings=(st, sh.target), out_shardings=rep)
        self.gather = jax.jit(lambda tree: tree, out_shardings=rep)
