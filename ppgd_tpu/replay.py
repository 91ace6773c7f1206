"""The replay window (SPEC 7): one policy per mode, the window's state, and the controller
that runs the step variant of each global step.

Step s trains on data batch s // k; window position t = s mod k [W1]. Each mode is one row
of `POLICIES` [W2]; everything that depends on the mode (the controller, what a checkpoint
holds and `resume.restore_window`, the step shardings, `ppgd-tpu shardings`, `ppgd-tpu
compile`, `bench replay`) reads it:

| mode  | t = 0      | 0 < t < k-1 | t = k-1     | opens by compute_ci | window holds               | restore rebuilds |
|-------|------------|-------------|-------------|---------------------|----------------------------|------------------|
| every | full       | full        | full        | no                  | -                          | -                |
| first | full_keep  | repeat      | repeat      | no                  | envelope                   | -                |
| last  | repeat     | repeat      | full        | yes                 | envelope                   | envelope         |
| mean  | mean_accum | mean_accum  | mean_update | yes                 | envelope, accumulator, V   | envelope         |

`full` is the plain step (SPEC 6), `full_keep` the same returning its envelope, `repeat` a
step on the window's envelope [W3], `mean_accum` a repeat that adds its envelope cotangent
to the accumulator, `mean_update` the last of those, then ONE CI update with the window
mean (step.py). A mode whose window opens by compute_ci makes its envelope with a plain CI
forward before the step at t = 0; `first`'s window is its t = 0 step's envelope. The CI fn
trains on the steps that run `full`, `full_keep` or `mean_update` (`CI_TRAINING`).

Where the CI fn reads V (`Decomposer.envelope_reads_V`), an envelope is a function of the
V it was made with and V moves inside a window: `mean` keeps that V (its CI update is taken
there), and no mode can rebuild its envelope after V moved. A mid-window checkpoint holds
every field of the window a restore cannot rebuild bit for bit [W6, C1]: the envelope is
rebuilt (compute_ci of the restored state, the CI fn unchanged since t = 0) only in the
modes marked so and with a CI fn that does not read V.

Every variant donates the train state; repeat variants receive (model, envelope) as their
first argument and spare it [W5]. With `Shardings` every variant is jitted with explicit
in/out shardings on the run's mesh (ppgd_tpu/mesh.py), and traced for that mesh
(tracing.py), so the math stays global-batch math and XLA inserts the collectives [D1, D2].
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ppgd_tpu import tracing
from ppgd_tpu.step import Decomposer, Envelope, TrainState, zero_accumulator


class Window(NamedTuple):
    """A replay window's state between its steps [W2, W6]; a field the mode does not hold
    is None (an empty subtree), and outside a window every field is. Its leaves are named
    `<prefix>/<field>/...` in a checkpoint (resume.py) and in the placement table
    (mesh.py)."""

    envelope: Envelope | Any = None  # the (lower, upper) CI the window's steps replay
    accumulator: Envelope | Any = None  # `mean`: the fp32 sum of the envelope cotangents
    envelope_V: dict | Any = None  # the V the envelope was made with (`mean`, CI fn reads V)


class Policy(NamedTuple):
    """One replay mode [W2] (a row of the module docstring's table)."""

    variants: tuple[str, str, str]  # the step variant at t = 0, 0 < t < k-1, t = k-1
    opens: bool  # t = 0 first makes the envelope by a plain CI forward (compute_ci)
    holds: tuple[str, ...]  # the Window fields of the mode (envelope_V: where the CI fn reads V)
    rebuilds: bool  # a restore rebuilds the envelope (compute_ci) unless the CI fn reads V

    def variant(self, t: int, k: int) -> str:
        """The step variant at window position t of a window of k steps."""
        return self.variants[0 if t == 0 else 2 if t == k - 1 else 1]

    def held(self, reads_V: bool) -> tuple[str, ...]:
        """The Window fields the mode holds inside a window."""
        return tuple(f for f in self.holds if f != "envelope_V" or reads_V)

    def stored(self, reads_V: bool) -> tuple[str, ...]:
        """The Window fields a mid-window checkpoint holds: what a restore cannot rebuild."""
        return tuple(f for f in self.held(reads_V)
                     if not (f == "envelope" and self.rebuilds and not reads_V))

    def programs(self) -> tuple[str, ...]:
        """The jitted programs the mode runs, in order of first use (`ppgd-tpu compile`)."""
        ordered = (("compute_ci",) if self.opens else ()) + self.variants
        return tuple(dict.fromkeys(ordered))


POLICIES = {
    "every": Policy(("full", "full", "full"), opens=False, holds=(), rebuilds=False),
    "first": Policy(("full_keep", "repeat", "repeat"), opens=False, holds=("envelope",),
                    rebuilds=False),
    "last": Policy(("repeat", "repeat", "full"), opens=True, holds=("envelope",),
                   rebuilds=True),
    "mean": Policy(("mean_accum", "mean_accum", "mean_update"), opens=True,
                   holds=("envelope", "accumulator", "envelope_V"), rebuilds=True),
}
CI_TRAINING = frozenset({"full", "full_keep", "mean_update"})  # the variants that train the CI fn


def window_template(dec: Decomposer, target, batch, fields=Window._fields) -> Window:
    """The abstract Window of a run (shapes only) with `fields` (envelope_V only where the
    CI fn reads V): what the step shardings place and `ppgd-tpu shardings` lists."""
    state = jax.eval_shape(dec.init, target)
    env = jax.eval_shape(dec.compute_ci, target, state, batch)
    full = Window(env, jax.eval_shape(zero_accumulator, env),
                  state.components.V if dec.envelope_reads_V else None)
    return only(full, fields)


def only(window: Window, fields) -> Window:
    """`window` with the fields outside `fields` None."""
    return Window(*(w if f in fields else None for f, w in zip(Window._fields, window)))


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


def _full(c, st, tg, b, w):
    st, m = c.full(st, tg, b)
    return st, Window(), m


def _full_keep(c, st, tg, b, w):
    st, env, m = c.full_keep(st, tg, b)
    return st, Window(env), m


def _repeat(c, st, tg, b, w):
    st, m = c.repeat((tg, w.envelope), st, b)
    return st, w, m


def _mean_accum(c, st, tg, b, w):
    st, acc, m = c.mean_accum((tg, w.envelope), st, w.accumulator, b)
    return st, w._replace(accumulator=acc), m


def _mean_update(c, st, tg, b, w):
    st, m = c.mean_update((tg, w.envelope, w.envelope_V), st, w.accumulator, b)
    return st, Window(), m


# How the controller calls each variant: (controller, state, target, batch, window) ->
# (state, the window after the step, metrics).
CALLS = {"full": _full, "full_keep": _full_keep, "repeat": _repeat, "mean_accum": _mean_accum,
         "mean_update": _mean_update}


class ReplayController:
    """Runs each global step's variant (`step`) and holds the replay window (`window`)."""

    def __init__(self, dec: Decomposer, shardings: Shardings | None = None):
        self.mode = dec.cfg.data.replay_ci_update
        self.k = dec.cfg.data.train_batch_replay
        self.policy = POLICIES[self.mode]
        self.held = self.policy.held(dec.envelope_reads_V)
        self.stored = self.policy.stored(dec.envelope_reads_V)

        def jit(fn, donate, ins=None, outs=None):
            if shardings is None:
                return jax.jit(fn, donate_argnums=donate)
            return jax.jit(tracing.traced_on(shardings.scalar.mesh, fn), donate_argnums=donate,
                           in_shardings=ins, out_shardings=outs)

        st, tg, b, env, sc = shardings or (None,) * 5
        v = None if st is None else st.components.V
        self.full = jit(dec.full, 0, (st, tg, b), (st, sc))
        self.full_keep = jit(dec.full_keep, 0, (st, tg, b), (st, env, sc))
        self.compute_ci = jit(dec.compute_ci, (), (tg, st, b), env)
        self.repeat = jit(dec.repeat, 1, ((tg, env), st, b), (st, sc))
        self.mean_accum = jit(dec.mean_accum, (1, 2), ((tg, env), st, env, b), (st, env, sc))
        # acc is not donated here: no output has its shape, so XLA could not reuse it.
        made_V = v if "envelope_V" in self.held else None
        self.mean_update = jit(dec.mean_update, 1, ((tg, env, made_V), st, env, b), (st, sc))
        self.copy_V = jit(copy_V, (), (st,), v)
        # jitted, so the accumulator arrives committed like mean_accum's own output: an eagerly
        # made one cost a second compile of mean_accum
        self.zero_acc = jit(zero_accumulator, (), (env,), env)
        self.window = Window()  # empty between windows

    def _open(self, state: TrainState, target, batch) -> Window:
        """The window's envelope from the current CI fn, and the other fields it holds."""
        env = self.compute_ci(target, state, batch)
        return Window(env, self.zero_acc(env) if "accumulator" in self.held else None,
                      self.copy_V(state) if "envelope_V" in self.held else None)

    def ci_updated(self, s: int) -> bool:
        """Whether global step s updates the CI fn."""
        return self.policy.variant(s % self.k, self.k) in CI_TRAINING

    def step(self, s: int, state: TrainState, target, batch):
        """Runs global step s; returns (state, device metrics)."""
        t = s % self.k
        if t == 0 and self.policy.opens:
            self.window = self._open(state, target, batch)
        state, self.window, m = CALLS[self.policy.variant(t, self.k)](
            self, state, target, batch, self.window)
        return state, m

    def saved(self) -> Window:
        """What a checkpoint inside the window holds of it (`stored`) [W6, C1]."""
        return only(self.window, self.stored)

    def stored_template(self, dec: Decomposer, target, batch) -> Window:
        """The abstract `saved()` of this run: what a restore reads from a checkpoint."""
        return window_template(dec, target, batch, self.stored)

    def resume(self, state: TrainState, target, batch, stored: Window) -> None:
        """The window at a mid-window restore from what the checkpoint held (`stored`):
        exactly the uninterrupted run's [W6]."""
        if not self.held:
            return
        env = stored.envelope
        if env is None:  # the CI fn has not moved since t = 0, nor does it read V
            env = self.compute_ci(target, state, batch)
        self.window = stored._replace(envelope=env)
