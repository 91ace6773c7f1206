"""One training step (SPEC 6) and its replay variants (SPEC 7), built from ONE implementation.

`Decomposer` holds what is static for a run (sites, C, plans, schedules); its methods are
the pure functions the loop jits: `init`, `compute_ci` (an envelope from a plain CI forward)
and the step variants replay.py's table runs, each a composition of the same parts:

- `_inputs`: the step key, target and batch in compute dtype, the clean output;
- gradients of the losses w.r.t. (components, sources, envelope) in one backward, with the
  CI either live (`_live_grads`: the CI fn runs on the taps and the envelope cotangent is
  pulled back through it) or replayed (`_replayed_grads`: a constant envelope [W3]); both
  on the rows `_on_live_rows` picks (live_rows.py: a `Subset`, `Subset.all` for every row);
- `_mean_ci_grad`: the CI fn's gradient from a window's accumulated envelope cotangent;
- `_update`: the components' (and, given its gradient, the CI fn's) optimizer step.

`full` = live gradients + update of both; `full_keep` the same on every row, returning its
envelope; `repeat` = replayed gradients + components' update; `mean_accum` = `repeat` that
accumulates the envelope cotangent; `mean_update` = `mean_accum` then one CI update from the
window mean [W2].
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from ppgd_tpu import axes, tracing
from ppgd_tpu.config import Config
from ppgd_tpu.decomp import adversary as adv_lib
from ppgd_tpu.decomp import ci_fn as ci_lib
from ppgd_tpu.decomp import components as comp_lib
from ppgd_tpu.decomp import live_rows as live_lib
from ppgd_tpu.decomp.live_rows import Subset
from ppgd_tpu.decomp import losses
from ppgd_tpu.decomp.schedules import adamw, apply_update, clip_by_global_norm, global_norm, \
    schedule_value
from ppgd_tpu.targets.base import MaskThunk, SiteMask, Target, site_shapes

# fold_in indices of the run key [R1]; draws never depend on the device layout.
_INIT_COMPONENTS, _INIT_CI, _INIT_ADV = 1, 2, 3
_STOCHASTIC, _PERSISTENT, _FRESH = 1000, 2000, 3000


class TrainState(eqx.Module):
    """All trajectory state [C1] (the frozen target and the data position are not in it).
    Logical axes (ppgd_tpu/axes.py): as its modules declare them; the optimizer states' as
    their parameters' (`axes.of(state, Decomposer.opt)`)."""

    step: jax.Array = axes.field()  # int32 scalar, the GLOBAL step
    components: comp_lib.Components
    ci_fn: Any
    opt_components: Any = axes.optimizer_state(of="components")
    opt_ci_fn: Any = axes.optimizer_state(of="ci_fn")
    adversaries: dict[str, adv_lib.Adversary]


class Envelope(eqx.Module):
    """A step's detached (lower, upper) CI pair, in compute dtype (SPEC 1); per site
    [*leading, C_s]. The fp32 cotangent accumulator of a `mean` window is one too."""

    lower: dict[str, jax.Array] = axes.field(axes.ROWS, "channels")
    upper: dict[str, jax.Array] = axes.field(axes.ROWS, "channels")


class Inputs(NamedTuple):
    """What a step reads of (state, target, batch) before its gradients (`_inputs`)."""

    key: jax.Array  # the step key [R1]
    step: jax.Array  # the GLOBAL step
    target: Target  # in compute dtype
    weights: dict[str, jax.Array]  # its fp32 site weights [S17]
    batch: Any  # in compute dtype
    clean: Any  # the clean output


class CIRows(NamedTuple):
    """How the envelope the losses read sits on the recon's rows."""

    lower: Callable  # the envelope's lower CI -> on the recon's rows
    counts: np.ndarray | None  # imp-min's weight of each envelope row (None: one each)


class Grads(NamedTuple):
    """What the masked forwards of a step give it (`Decomposer._recon_grads`)."""

    advs: dict[str, adv_lib.Adversary]  # after the final ascent
    parts: dict[str, jax.Array]  # the loss and its terms
    g_comp: Any  # the components' gradient
    g_env: Envelope | None  # the envelope's cotangent; None with the CI fn live
    g_ci: Any  # the CI fn's gradient; None with it replayed
    env: Envelope | None  # the envelope the losses read (None out of the live-rows switch)


def _cast(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
                        else x, tree)


class Decomposer:
    """The static description of a decomposition run and its pure step functions."""

    def __init__(self, cfg: Config, target: Target, batch_shape: tuple[int, ...]):
        self.cfg = cfg
        # shapes only: `target` may hold arrays or ShapeDtypeStructs (ppgd-tpu compile)
        weights = site_shapes(target)
        self.C = comp_lib.resolve_sites(cfg.decomp.sites, tuple(weights))
        self.ties = comp_lib.resolve_ties(cfg.decomp.tie, self.C,
                                          {s: w.shape for s, w in weights.items()})
        self.sites = tuple(self.C)  # canonical order; dict order inside jit is sorted
        self.d_in = target.tap_widths()  # every tap a CI fn may read, site inputs included
        self.leading = target.leading_shape(tuple(batch_shape))
        self.steps = cfg.decomp.steps
        self.opt = adamw(cfg.decomp.weight_decay)
        self.dtype = jnp.bfloat16 if cfg.decomp.compute_dtype == "bfloat16" else jnp.float32
        self.plans = {n: losses.stochastic_plan(t, self.sites)
                      for n, t in cfg.loss.stochastic.items()}
        self.run_key = lambda: jax.random.key(cfg.seed)
        # the CI fn's values depend on V (the per-component family): an envelope is a
        # function of the V it was computed with, and V moves inside a replay window
        # (a `mean` window keeps the V its envelope was made with: replay.py)
        self.envelope_reads_V = ci_lib.reads_V(cfg.decomp.ci_fn.kind)
        # live_rows.py: a position-less target's recon forwards may skip all-zero rows
        # (done where the program runs on CPU: `live_rows`)
        self.live_sizes = live_lib.sizes(self.leading[0], target.live_row_probability)
        self.skip_dead_rows = len(self.leading) == 1 and len(self.live_sizes) > 1

    # ------------------------------------------------------------ state

    def init(self, target: Target) -> TrainState:
        key = self.run_key()
        comps = comp_lib.tie(comp_lib.init(jax.random.fold_in(key, _INIT_COMPONENTS),
                                           target.site_weights(), self.C), self.ties)
        ci_fn = ci_lib.init(self.cfg.decomp.ci_fn, jax.random.fold_in(key, _INIT_CI), self.d_in,
                            self.C)
        advs = {n: adv_lib.init(jax.random.fold_in(jax.random.fold_in(key, _INIT_ADV), i),
                                t.scope, self.leading, self.C)
                for i, (n, t) in enumerate(self.cfg.loss.persistent_pgd.items())}
        return TrainState(step=jnp.int32(0), components=comps, ci_fn=ci_fn,
                          opt_components=self.opt.init(comps), opt_ci_fn=self.opt.init(ci_fn),
                          adversaries=advs)

    def faithfulness_warmup(self, state: TrainState, target: Target) -> TrainState:
        """[S21] n AdamW steps on faithfulness alone; that optimizer is discarded. In one
        call (tests; the loop runs `faithfulness_warmup_part` in parts, to see a stop)."""
        opt_state = self.warmup_optimizer_state(state)
        n = self.cfg.decomp.faithfulness_warmup_steps
        return self.faithfulness_warmup_part(state, opt_state, target, n)[0]

    def _warmup_optimizer(self):
        return adamw(self.cfg.decomp.faithfulness_warmup_weight_decay)

    def warmup_optimizer_state(self, state: TrainState):
        """The faithfulness warmup's own AdamW state, fresh [S21]."""
        return self._warmup_optimizer().init(state.components)

    def faithfulness_warmup_part(self, state: TrainState, opt_state, target: Target, count):
        """`count` (traced: one program for any part) steps of the warmup from `opt_state`;
        -> (state, opt_state). The loop runs the warmup in parts, so that a stop between two
        is seen while a long warmup computes [C5]."""
        weights = target.site_weights()
        lr = self.cfg.decomp.faithfulness_warmup_lr
        opt = self._warmup_optimizer()

        def body(_, carry):
            comps, opt_state = carry
            g = comp_lib.tie_grads(jax.grad(comp_lib.faithfulness)(comps, weights), self.ties)
            comps, opt_state = apply_update(comps, g, opt_state, opt, lr)
            return comp_lib.tie(comps, self.ties), opt_state

        comps, opt_state = jax.lax.fori_loop(0, count, body, (state.components, opt_state))
        return eqx.tree_at(lambda s: s.components, state, comps), opt_state

    # ------------------------------------------------------------ pieces

    def ci(self, ci_fn, components, target: Target, batch) -> ci_lib.CI:
        """[S5] CI = CI_FN(taps) with the squashings."""
        taps = target.read_activations(batch, ci_fn.input_names)
        return ci_lib.ci_from_logits(ci_fn(taps, components))

    def _envelope(self, ci_fn, components, taps) -> Envelope:
        """[S5] the CI of `taps` in compute dtype, as the losses read it: the one definition
        the live step, its vjp and compute_ci share (a replayed envelope must be bitwise
        the live one [W6])."""
        ci = ci_lib.ci_from_logits(ci_fn(taps, components))
        return Envelope(_cast(ci.lower, self.dtype), _cast(ci.upper, self.dtype))

    def live_rows(self, target: Target, batch) -> live_lib.LiveRows | None:
        """The rows a step's recon forwards must run on (live_rows.py); None: all of them
        (always off CPU: tracing.platform())."""
        if not self.skip_dead_rows or tracing.platform() != "cpu":
            return None
        return live_lib.find(target.read_activations(batch, self.sites), self.live_sizes)

    def recon(self, target: Target, batch, components, masks: dict[str, SiteMask | MaskThunk],
              clean):
        """One masked forward in compute dtype against the clean output; fp32 divergence."""
        return target.divergence(target.masked_forward(batch, components, masks), clean)

    def ppgd_masks(self, lower, sources) -> dict[str, MaskThunk]:
        """[S12] all sites live, routed everywhere, masks from the adversary's sources (built
        at each site inside the forward); `lower` and `sources` on the same rows."""
        use_delta = self.cfg.decomp.use_delta
        return {s: functools.partial(losses.mask_from_source, lower[s], sources[s], use_delta)
                for s in self.sites}

    def _recon_on(self, x: Inputs, rows: Subset, components, masks):
        """`recon` of `x` (batch and clean output on `rows`) as its share of the batch mean."""
        return rows.share(self.recon(x.target, x.batch, components, masks, x.clean))

    def _detached_ppgd_objective(self, x: Inputs, rows: Subset, comps_c, lower):
        """sources -> the all-sites route-all recon [S12] with the components and the CI
        detached: what an adversary's own ascents push up [S24] (`x` on `rows`)."""
        frozen = jax.lax.stop_gradient((comps_c, lower))
        return lambda sources: self._recon_on(x, rows, frozen[0],
                                              self.ppgd_masks(frozen[1], sources))

    def _losses(self, x: Inputs, rows: Subset, ci_rows: CIRows, components, sources,
                env: Envelope):
        """Total loss and its parts as a function of (components, sources, envelope), the
        recon terms on `rows` (`x`'s batch and clean output, the `bsc` sources: those rows'),
        the envelope's lower CI on them by `ci_rows` [S6-S12, S17]."""
        cfg = self.cfg
        comps_c = _cast(components, self.dtype)
        lower = ci_rows.lower(env.lower)

        def recon(masks, comps=comps_c):
            return self._recon_on(x, rows, comps, masks)

        parts = {"faithfulness": comp_lib.faithfulness(components, x.weights)}
        p = schedule_value(cfg.loss.imp_min.p, x.step, self.steps)
        gamma = schedule_value(cfg.loss.imp_min.gamma, x.step, self.steps)
        imp, _, _ = losses.imp_min(env.upper, cfg.loss.imp_min, p, gamma, ci_rows.counts)
        parts["imp_min"] = imp
        total = cfg.loss.faithfulness_coeff * parts["faithfulness"] + imp
        for i, (name, term) in enumerate(cfg.loss.stochastic.items()):
            k = jax.random.fold_in(x.key, _STOCHASTIC + i)
            parts[name] = losses.stochastic_recon(k, term, self.plans[name], lower, recon,
                                                  cfg.decomp.use_delta, rows)
            total = total + term.coeff * parts[name]
        for name, term in cfg.loss.persistent_pgd.items():
            parts[name] = recon(self.ppgd_masks(lower, sources[name]))
            total = total + term.coeff * parts[name]
        for i, (name, term) in enumerate(cfg.loss.fresh_pgd.items()):
            k = jax.random.fold_in(x.key, _FRESH + i)
            obj = self._detached_ppgd_objective(x, rows, comps_c, lower)
            src = adv_lib.sign_pgd(k, term.scope, self.leading, self.C, term.n_steps,
                                   term.step_size, lambda s: obj(rows.take(s)))
            parts[name] = recon(self.ppgd_masks(lower, rows.take(src)))
            total = total + term.coeff * parts[name]
        parts["total"] = total
        return total, parts

    # ------------------------------------------------------------ the step's parts

    def _inputs(self, step, target: Target, batch) -> Inputs:
        """Global step `step`'s key [R1], the target and batch in compute dtype, the clean
        output."""
        key = jax.random.fold_in(self.run_key(), step)
        target_c = _cast(target, self.dtype)
        batch_c = batch.astype(self.dtype) if jnp.issubdtype(batch.dtype, jnp.floating) else batch
        clean = target_c.clean_output(batch_c)
        return Inputs(key, step, target_c, target.site_weights(), batch_c, clean)

    def _on_live_rows(self, x: Inputs, grads, ci_reads: tuple[str, ...] = ()) -> Grads:
        """`grads(rows)` on the rows the step's recon forwards must run on (live_rows.py):
        one `lax.switch` over the live-rows sizes, or every row. `ci_reads`: the taps a CI
        fn live in `grads` reads (only site inputs can be read on a subset)."""
        live = self.live_rows(x.target, x.batch)
        if live is None:
            return grads(Subset.all(self.leading[0]))
        assert set(ci_reads) <= set(self.sites), \
            "live_rows.py: a CI fn reading more than site inputs needs every row"
        return live_lib.switch(live, self.live_sizes, lambda rows: grads(rows)._replace(env=None))

    def _envelope_vjp(self, state: TrainState, taps):
        """The envelope of `taps` and its vjp -> (CI-fn cotangent, component cotangent or
        None)."""
        grads_into_components = getattr(state.ci_fn, "grads_into_components", False)
        envelope_of = lambda ci_fn, comps: self._envelope(ci_fn, comps, taps)
        if grads_into_components:
            return jax.vjp(envelope_of, state.ci_fn, state.components)
        env, vjp = jax.vjp(lambda f: envelope_of(f, state.components), state.ci_fn)
        return env, lambda g: (vjp(g)[0], None)

    def _recon_grads(self, state: TrainState, x: Inputs, rows: Subset, env: Envelope,
                     ci_rows: CIRows) -> Grads:
        """The warmup ascents, the losses and their gradient w.r.t. (components, sources,
        envelope), the final ascent: everything that runs masked forwards, on `rows`.

        On a subset of rows the `bsc` adversaries ascend on those rows only; every other
        row's gradient is exactly 0 in all n_warmup + 1 ascents (its recon divergence cannot
        move), so its Adam steps are the zero-gradient ones, taken on the full arrays, and
        the rows' results are written over them [S13-S15]."""
        batch, clean = rows.take((x.batch, x.clean))
        x = x._replace(batch=batch, clean=clean)
        lower = ci_rows.lower(env.lower)
        terms = self.cfg.loss.persistent_pgd
        lrs = {n: schedule_value(t.lr, x.step, self.steps) for n, t in terms.items()}
        advs = rows.take(dict(state.adversaries))
        # [S24] warmup ascents against the all-sites route-all forward, comps and CI detached.
        obj = self._detached_ppgd_objective(x, rows, _cast(state.components, self.dtype), lower)
        for name, term in terms.items():
            for _ in range(term.n_warmup):
                advs[name] = adv_lib.ascend(advs[name], jax.grad(obj)(advs[name].sources), term,
                                            lrs[name])

        sources = {n: a.sources for n, a in advs.items()}
        loss = functools.partial(self._losses, x, rows, ci_rows)
        (_, parts), (g_comp, g_src, g_env) = jax.value_and_grad(
            loss, argnums=(0, 1, 2), has_aux=True)(state.components, sources, env)
        # [S13, S14] final ascent from the same backward, grad / coeff, before any update.
        for name, term in terms.items():
            g = {s: v / term.coeff for s, v in g_src[name].items()}
            advs[name] = adv_lib.ascend(advs[name], g, term, lrs[name])
        advs = rows.put(advs, lambda: {
            n: adv_lib.idle_ascents(a, terms[n].n_warmup + 1, terms[n], lrs[n])
            for n, a in state.adversaries.items()})
        return Grads(advs, parts, g_comp, g_env, None, env)

    def _replayed_grads(self, state: TrainState, target: Target, batch,
                        env: Envelope) -> Grads:
        """[W3] the gradients with the CI a constant, the batch's envelope `env` (`g_env`: its
        cotangent): no taps read, no CI fn; on the live rows."""
        x = self._inputs(state.step, target, batch)
        return self._on_live_rows(x, lambda rows: self._recon_grads(
            state, x, rows, env, CIRows(rows.take, None)))

    def _live_grads(self, state: TrainState, x: Inputs, taps, rows: Subset) -> Grads:
        """SPEC 6's gradients with the CI fn live on `taps`: on `rows` plus (on a subset) one
        all-zero row standing for the batch's other rows (all dead, so all with that row's
        CI: the toy CI fns read site inputs only and map rows independently); the envelope
        cotangent pulled back through it gives `g_ci` (and the CI path into V)."""
        env, ci_vjp = self._envelope_vjp(state, rows.take_and_zero_row(taps))
        g = self._recon_grads(state, x, rows, env, CIRows(rows.head, rows.counts))
        g_ci, g_comp_ci = ci_vjp(g.g_env)
        g_comp = g.g_comp if g_comp_ci is None else jax.tree.map(jnp.add, g.g_comp, g_comp_ci)
        return g._replace(g_comp=g_comp, g_env=None, g_ci=g_ci)

    def _mean_ci_grad(self, state: TrainState, env_V, taps, acc: Envelope, env: Envelope):
        """`mean` [W2]: the window-mean cotangent `acc` / k pulled back through ONE CI-fn vjp
        of the function that made `env`: at `env_V`, the V it was made with (None: the
        state's, where the CI fn does not read V). Its component cotangent is dropped: they
        had theirs each step."""
        made = state if env_V is None else eqx.tree_at(lambda st: st.components.V, state, env_V)
        _, ci_vjp = self._envelope_vjp(made, taps)
        k = self.cfg.data.train_batch_replay
        return ci_vjp(jax.tree.map(lambda a, e: (a / k).astype(e.dtype), acc, env))[0]

    def _update(self, state: TrainState, g: Grads, g_ci=None):
        """[S19, S20] the optimizer steps: components from `g`, the CI fn from `g_ci` (None:
        it and its optimizer state pass through bit-untouched, and its grad-norm metrics are
        absent [W3]) -> (state at step + 1, metrics)."""
        cfg = self.cfg
        step = state.step
        lr_c = schedule_value(cfg.decomp.lr_components, step, self.steps)
        g_comp = comp_lib.tie_grads(g.g_comp, self.ties)
        g_norm_c = global_norm(g_comp)
        g_comp = clip_by_global_norm(g_comp, cfg.decomp.grad_clip_components)
        comps, opt_c = apply_update(state.components, g_comp, state.opt_components, self.opt, lr_c)
        comps = comp_lib.tie(comps, self.ties)

        metrics = {f"train/loss/{k}": v for k, v in g.parts.items()}
        metrics["train/lr/components"] = lr_c
        metrics["train/grad_norms/summary/components"] = g_norm_c
        ci_fn, opt_ci = state.ci_fn, state.opt_ci_fn
        if g_ci is not None:
            # [W4] unit-LR optimizer; the CI LR is the schedule at the GLOBAL step.
            lr_ci = schedule_value(cfg.decomp.lr_ci_fn, step, self.steps)
            ci_fn, opt_ci = apply_update(state.ci_fn, g_ci, state.opt_ci_fn, self.opt, lr_ci)
            g_norm_ci = global_norm(g_ci)
            metrics["train/lr/ci_fn"] = lr_ci
            metrics["train/grad_norms/summary/ci_fn"] = g_norm_ci
            metrics["train/grad_norms/summary/total"] = jnp.sqrt(g_norm_c ** 2 + g_norm_ci ** 2)
        new = TrainState(step=step + 1, components=comps, ci_fn=ci_fn, opt_components=opt_c,
                         opt_ci_fn=opt_ci, adversaries=g.advs)
        return new, metrics

    # ------------------------------------------------------------ the variants (SPEC 7)

    def full(self, state: TrainState, target: Target, batch):
        """The plain step (SPEC 6): what `every` runs, bit for bit."""
        x = self._inputs(state.step, target, batch)
        taps = target.read_activations(batch, state.ci_fn.input_names)
        g = self._on_live_rows(x, lambda rows: self._live_grads(state, x, taps, rows),
                               state.ci_fn.input_names)
        return self._update(state, g, g.g_ci)

    def full_keep(self, state: TrainState, target: Target, batch):
        """The plain step on every row, also returning its envelope (`first` at t = 0)."""
        x = self._inputs(state.step, target, batch)
        taps = target.read_activations(batch, state.ci_fn.input_names)
        g = self._live_grads(state, x, taps, Subset.all(self.leading[0]))
        new, metrics = self._update(state, g, g.g_ci)
        return new, jax.lax.stop_gradient(g.env), metrics

    def compute_ci(self, target: Target, state: TrainState, batch) -> Envelope:
        """An envelope from a plain CI forward: no vjp, no update."""
        taps = target.read_activations(batch, state.ci_fn.input_names)
        return jax.lax.stop_gradient(self._envelope(state.ci_fn, state.components, taps))

    def repeat(self, model_env, state: TrainState, batch):
        """[W3] a step on the cached envelope: no taps, no CI fn forward or backward; the CI
        fn and its optimizer state pass through untouched. [W5] `model_env` = (target,
        envelope) is the first argument so donating the others never frees it."""
        target, env = model_env
        return self._update(state, self._replayed_grads(state, target, batch, env))

    def mean_accum(self, model_env, state: TrainState, acc: Envelope, batch):
        """`mean`, t < k-1: a repeat step that adds its envelope cotangent (fp32) to `acc`."""
        target, env = model_env
        g = self._replayed_grads(state, target, batch, env)
        acc = _accumulate(acc, g.g_env)
        new, metrics = self._update(state, g)
        return new, acc, metrics

    def mean_update(self, model_env, state: TrainState, acc: Envelope, batch):
        """`mean`, t = k-1: the last repeat step, then ONE CI update with the window mean.
        `model_env` = (target, envelope, the V that made the envelope: None where the CI fn
        does not read V)."""
        target, env, env_V = model_env
        g = self._replayed_grads(state, target, batch, env)
        acc = _accumulate(acc, g.g_env)
        taps = target.read_activations(batch, state.ci_fn.input_names)
        return self._update(state, g, self._mean_ci_grad(state, env_V, taps, acc, env))


def _accumulate(acc: Envelope, g_env: Envelope) -> Envelope:
    """A `mean` window's accumulator plus one step's envelope cotangent, in fp32 [W2]."""
    return jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, g_env)


def zero_accumulator(env: Envelope) -> Envelope:
    """The fp32 cotangent accumulator of a `mean` window."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), env)
