"""The replay-window controller (SPEC 7): which step variant runs at each global step, and
the envelope / accumulator lifecycle.

Step s trains on data batch s // k; window position t = s mod k [W1]. Per mode [W2]:

| mode  | t = 0                              | 0 < t < k-1 | t = k-1                    |
|-------|------------------------------------|-------------|----------------------------|
| every | full                               | full        | full                       |
| first | full, keep its envelope            | repeat      | repeat                     |
| last  | compute_ci, then repeat            | repeat      | full                       |
| mean  | compute_ci, then accumulate        | accumulate  | accumulate + one CI update |

The CI update of `mean` pulls the window's cotangent back through the function that made
the envelope; where the CI fn reads V the window keeps a copy of the V it was made with
(`env_V`; `Decomposer.window_keeps_V`), since V moves inside the window.

Every variant donates the train state; repeat variants receive (model, envelope) as their
first argument and spare it [W5]. With `Shardings` every variant is jitted with explicit
in/out shardings on the run's mesh (ppgd_tpu/mesh.py), and traced for that mesh
(tracing.py), so the math stays global-batch math and XLA inserts the collectives [D1, D2]. A loop that resumes mid-window gets the window's
state from the checkpoint (`resume.restore_window`), exactly [W6].
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ppgd_tpu import tracing
from ppgd_tpu.step import Decomposer, Envelope, TrainState, zero_accumulator


class Shardings(NamedTuple):
    """Trees of NamedShardings for the step inputs/outputs; `scalar` covers the metrics."""

    state: Any
    target: Any
    batch: Any
    env: Any  # also the fp32 accumulator's (same shapes)
    scalar: Any


def copy_V(state: TrainState) -> dict:
    """The components' V, copied: the next step donates the state it is taken from."""
    return jax.tree.map(jnp.copy, state.components.V)


# The jitted variants (ReplayController attributes) each mode runs in a window, in order of
# first use: what `ppgd-tpu compile` compiles for a mode.
VARIANTS = {"every": ("full",), "first": ("full_keep", "repeat"),
            "last": ("compute_ci", "repeat", "full"),
            "mean": ("compute_ci", "mean_accum", "mean_update")}


class ReplayController:
    def __init__(self, dec: Decomposer, shardings: Shardings | None = None):
        self.mode = dec.cfg.data.replay_ci_update
        self.k = dec.cfg.data.train_batch_replay
        self.envelope_reads_V = dec.envelope_reads_V
        self.window_keeps_V = dec.window_keeps_V

        def jit(fn, donate, ins=None, outs=None):
            if shardings is None:
                return jax.jit(fn, donate_argnums=donate)
            return jax.jit(tracing.traced_on(shardings.scalar.mesh, fn), donate_argnums=donate,
                           in_shardings=ins, out_shardings=outs)

        st, tg, b, env, sc = shardings or (None,) * 5
        self.full = jit(dec.full, 0, (st, tg, b), (st, sc))
        self.full_keep = jit(dec.full_keep, 0, (st, tg, b), (st, env, sc))
        self.compute_ci = jit(dec.compute_ci, (), (tg, st, b), env)
        self.repeat = jit(dec.repeat, 1, ((tg, env), st, b), (st, sc))
        self.mean_accum = jit(dec.mean_accum, (1, 2), ((tg, env), st, env, b), (st, env, sc))
        # acc is not donated here: no output has its shape, so XLA could not reuse it.
        v = None if st is None else st.components.V
        made = (tg, env, v) if self.window_keeps_V else (tg, env)
        self.mean_update = jit(dec.mean_update, 1, (made, st, env, b), (st, sc))
        self.copy_V = jit(copy_V, (), (st,), v)
        # jitted, so the accumulator arrives committed like mean_accum's own output: an eagerly
        # made one cost a second compile of mean_accum
        self.zero_acc = jit(zero_accumulator, (), (env,), env)
        self.env: Envelope | None = None
        self.acc: Envelope | None = None
        self.env_V: dict | None = None

    def _open(self, state: TrainState, target, batch) -> None:
        """The window's envelope from the current CI fn (and what `mean` adds to it)."""
        self.env = self.compute_ci(target, state, batch)
        self.acc = self.zero_acc(self.env) if self.mode == "mean" else None
        self.env_V = self.copy_V(state) if self.window_keeps_V else None

    def ci_updated(self, s: int) -> bool:
        """Whether global step s updates the CI fn."""
        t = s % self.k
        return self.mode == "every" or (self.mode == "first" and t == 0) or (
            self.mode in ("last", "mean") and t == self.k - 1)

    def step(self, s: int, state: TrainState, target, batch):
        """Runs global step s; returns (state, device metrics)."""
        t = s % self.k
        if self.mode == "every":
            return self.full(state, target, batch)
        if self.mode == "first":
            if t == 0:
                state, self.env, m = self.full_keep(state, target, batch)
                return state, m
            return self.repeat((target, self.env), state, batch)
        if t == 0:
            self._open(state, target, batch)
        if self.mode == "last":
            if t < self.k - 1:
                return self.repeat((target, self.env), state, batch)
            self.env = None
            return self.full(state, target, batch)
        if t < self.k - 1:
            state, self.acc, m = self.mean_accum((target, self.env), state, self.acc, batch)
            return state, m
        made = (target, self.env, self.env_V) if self.window_keeps_V else (target, self.env)
        state, m = self.mean_update(made, state, self.acc, batch)
        self.env = self.acc = self.env_V = None
        return state, m
