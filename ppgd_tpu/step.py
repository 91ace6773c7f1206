"""One training step (SPEC 6) and its replay variants (SPEC 7), built from ONE implementation.

`Decomposer` holds what is static for a run (sites, C, plans, schedules); its methods are
the pure functions the loop jits: `init`, `full` (the plain step), `repeat` (a step on a
cached envelope: no taps, no CI fn forward/backward [W3]), `compute_ci` (an envelope from a
plain CI forward). The step variants (`full`, `full_keep`, `repeat`, `mean_accum`,
`mean_update`) all run `_step`, which computes the losses as a function of
(components, sources, envelope) in one backward and, when the CI fn trains, pulls the
envelope cotangent back through one CI-fn vjp.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp

from ppgd_tpu import tracing
from ppgd_tpu.config import Config
from ppgd_tpu.decomp import adversary as adv_lib
from ppgd_tpu.decomp import ci_fn as ci_lib
from ppgd_tpu.decomp import components as comp_lib
from ppgd_tpu.decomp import live_rows as live_lib
from ppgd_tpu.decomp import losses
from ppgd_tpu.decomp.schedules import adamw, apply_update, clip_by_global_norm, global_norm, \
    schedule_value
from ppgd_tpu.targets.base import MaskThunk, SiteMask, Target, site_shapes

# fold_in indices of the run key [R1]; draws never depend on the device layout.
_INIT_COMPONENTS, _INIT_CI, _INIT_ADV = 1, 2, 3
_STOCHASTIC, _PERSISTENT, _FRESH = 1000, 2000, 3000


class TrainState(eqx.Module):
    """All trajectory state [C1] (the frozen target and the data position are not in it)."""

    step: jax.Array  # int32 scalar, the GLOBAL step
    components: comp_lib.Components
    ci_fn: Any
    opt_components: Any
    opt_ci_fn: Any
    adversaries: dict[str, adv_lib.Adversary]


class Envelope(NamedTuple):
    """A step's detached (lower, upper) CI pair, in compute dtype (SPEC 1)."""

    lower: dict[str, jax.Array]
    upper: dict[str, jax.Array]


class ReconPart(NamedTuple):
    """What the masked forwards of a step give it (`Decomposer._recon_part`)."""

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
              clean, rows: live_lib.Subset | None = None):
        """One masked forward in compute dtype against the clean output; fp32 divergence.
        With `rows`, batch, clean and masks hold those rows: their share of the batch mean."""
        div = target.divergence(target.masked_forward(batch, components, masks), clean)
        return div if rows is None else div * rows.scale

    def ppgd_masks(self, lower, sources) -> dict[str, MaskThunk]:
        """[S12] all sites live, routed everywhere, masks from the adversary's sources (built
        at each site inside the forward); `lower` and `sources` on the same rows."""
        use_delta = self.cfg.decomp.use_delta
        return {s: functools.partial(losses.mask_from_source, lower[s], sources[s], use_delta)
                for s in self.sites}

    def _detached_ppgd_objective(self, target: Target, batch, clean, comps_c, lower,
                                 rows: live_lib.Subset | None):
        """sources -> the all-sites route-all recon [S12] with the components and the CI
        detached: what an adversary's own ascents push up [S24] (on `rows` when given)."""
        frozen = jax.lax.stop_gradient((comps_c, lower))
        return lambda sources: self.recon(target, batch, frozen[0],
                                          self.ppgd_masks(frozen[1], sources), clean, rows)

    def _losses(self, key, step, target, weights, batch, clean, components, sources,
                env: Envelope, rows: live_lib.Subset | None = None, env_on_rows: bool = False):
        """Total loss and its parts as a function of (components, sources, envelope); the
        recon terms on `rows` (their batch, clean output and `bsc` sources) when given. The
        envelope is the batch's, or with `env_on_rows` that of `rows.take_and_zero_row`.
        `target` is in compute dtype, `weights` are its fp32 site weights [S17]."""
        cfg = self.cfg
        comps_c = _cast(components, self.dtype)
        lower, counts = _rows_of(env.lower, rows, env_on_rows)

        def recon(masks, comps=comps_c):
            return self.recon(target, batch, comps, masks, clean, rows)

        parts = {"faithfulness": comp_lib.faithfulness(components, weights)}
        p = schedule_value(cfg.loss.imp_min.p, step, self.steps)
        gamma = schedule_value(cfg.loss.imp_min.gamma, step, self.steps)
        imp, _, _ = losses.imp_min(env.upper, cfg.loss.imp_min, p, gamma, counts)
        parts["imp_min"] = imp
        total = cfg.loss.faithfulness_coeff * parts["faithfulness"] + imp
        for i, (name, term) in enumerate(cfg.loss.stochastic.items()):
            k = jax.random.fold_in(key, _STOCHASTIC + i)
            parts[name] = losses.stochastic_recon(k, term, self.plans[name], lower, recon,
                                                  cfg.decomp.use_delta, rows)
            total = total + term.coeff * parts[name]
        for name, term in cfg.loss.persistent_pgd.items():
            parts[name] = recon(self.ppgd_masks(lower, sources[name]))
            total = total + term.coeff * parts[name]
        for i, (name, term) in enumerate(cfg.loss.fresh_pgd.items()):
            k = jax.random.fold_in(key, _FRESH + i)
            on_rows = (lambda s: s) if rows is None else rows.take
            obj = self._detached_ppgd_objective(target, batch, clean, comps_c, lower, rows)
            src = adv_lib.sign_pgd(k, term.scope, self.leading, self.C, term.n_steps,
                                   term.step_size, lambda s: obj(on_rows(s)))
            parts[name] = recon(self.ppgd_masks(lower, on_rows(src)))
            total = total + term.coeff * parts[name]
        parts["total"] = total
        return total, parts

    # ------------------------------------------------------------ the step

    def _envelope_vjp(self, state: TrainState, taps):
        """The envelope of `taps` and its vjp -> (CI-fn cotangent, component cotangent or
        None)."""
        grads_into_components = getattr(state.ci_fn, "grads_into_components", False)
        envelope_of = lambda ci_fn, comps: self._envelope(ci_fn, comps, taps)
        if grads_into_components:
            return jax.vjp(envelope_of, state.ci_fn, state.components)
        env, vjp = jax.vjp(lambda f: envelope_of(f, state.components), state.ci_fn)
        return env, lambda g: (vjp(g)[0], None)

    def _recon_part(self, state: TrainState, env: Envelope | None, taps, key, target, weights,
                    batch, clean, rows: live_lib.Subset | None):
        """The warmup ascents, the losses and their gradient w.r.t. (components, sources,
        envelope), the final ascent: everything that runs masked forwards, on `rows` (None:
        all).

        On `rows` the `bsc` adversaries ascend on those rows only; every other row's
        gradient is exactly 0 in all n_warmup + 1 ascents (its recon divergence cannot
        move), so its Adam steps are the zero-gradient ones, taken on the full arrays before
        the rows' results are written over them [S13-S15].

        With the CI fn live (`env` None, its `taps` given) it runs here too: on `rows` plus
        one all-zero row standing for the batch's other rows (all dead, so all with that
        row's CI: the toy CI fns read site inputs only and map rows independently), and the
        envelope cotangent is pulled back through it."""
        step = state.step
        ci_vjp, env_on_rows = None, env is None and rows is not None
        if env is None:
            env, ci_vjp = self._envelope_vjp(state, rows.take_and_zero_row(taps)
                                             if env_on_rows else taps)
        if rows is not None:
            batch, clean = rows.take((batch, clean))
        lower, _ = _rows_of(env.lower, rows, env_on_rows)
        terms = self.cfg.loss.persistent_pgd
        lrs = {n: schedule_value(t.lr, step, self.steps) for n, t in terms.items()}
        advs = dict(state.adversaries)
        if rows is not None:
            advs = rows.take(advs)
        # [S24] warmup ascents against the all-sites route-all forward, comps and CI detached.
        obj = self._detached_ppgd_objective(target, batch, clean,
                                            _cast(state.components, self.dtype), lower, rows)
        for name, term in terms.items():
            for _ in range(term.n_warmup):
                advs[name] = adv_lib.ascend(advs[name], jax.grad(obj)(advs[name].sources), term,
                                            lrs[name])

        sources = {n: a.sources for n, a in advs.items()}
        loss = lambda c, s, e: self._losses(key, step, target, weights, batch, clean, c, s, e,
                                            rows, env_on_rows)
        (_, parts), (g_comp, g_src, g_env) = jax.value_and_grad(
            loss, argnums=(0, 1, 2), has_aux=True)(state.components, sources, env)
        # [S13, S14] final ascent from the same backward, grad / coeff, before any update.
        for name, term in terms.items():
            g = {s: x / term.coeff for s, x in g_src[name].items()}
            advs[name] = adv_lib.ascend(advs[name], g, term, lrs[name])
        if rows is not None:
            idle = {n: adv_lib.idle_ascents(a, terms[n].n_warmup + 1, terms[n], lrs[n])
                    for n, a in state.adversaries.items()}
            advs = rows.put(idle, advs)
        if ci_vjp is None:
            return ReconPart(advs, parts, g_comp, g_env, None, env)
        g_ci, g_comp_ci = ci_vjp(g_env)
        if g_comp_ci is not None:
            g_comp = jax.tree.map(jnp.add, g_comp, g_comp_ci)  # CI path into V
        return ReconPart(advs, parts, g_comp, None, g_ci, env)

    def _step(self, state: TrainState, target: Target, batch, env: Envelope | None,
              acc: Envelope | None = None, update_ci_from_acc: bool = False,
              keep_env: bool = False, env_V: dict | None = None):
        """SPEC 6 with the CI fn live (`env` None) or replayed from `env` [W3].

        With `acc`, the envelope cotangent (fp32) is added to it; with `update_ci_from_acc`
        the window-mean cotangent is pulled back through ONE CI-fn vjp and applied (the
        `mean` mode's last step [W2]): the vjp of the function that made `env`, so at the
        V it was made with (`env_V`, where `envelope_reads_V`). `keep_env`: return the
        batch's envelope (the recon then runs on every row).
        """
        cfg = self.cfg
        step = state.step
        key = jax.random.fold_in(self.run_key(), step)
        target_c = _cast(target, self.dtype)
        batch_c = batch.astype(self.dtype) if jnp.issubdtype(batch.dtype, jnp.floating) else batch
        clean = target_c.clean_output(batch_c)

        ci_live = env is None
        taps = target.read_activations(batch, state.ci_fn.input_names) if ci_live else None
        recon_part = functools.partial(self._recon_part, state, env, taps, key, target_c,
                                       target.site_weights(), batch_c, clean)
        live = None if keep_env else self.live_rows(target_c, batch_c)
        if live is None:
            advs, parts, g_comp, g_env, g_ci, new_env = recon_part(None)
        else:  # new_env: only full_keep returns it, and it runs every row
            assert not ci_live or set(state.ci_fn.input_names) <= set(self.sites), \
                "live_rows.py: a CI fn reading more than site inputs needs every row"
            advs, parts, g_comp, g_env, g_ci, new_env = live_lib.switch(
                live, self.live_sizes, lambda rows: recon_part(rows)._replace(env=None))

        if acc is not None:
            acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, g_env)
        if update_ci_from_acc:
            # the components' cotangent of this vjp is dropped: they had theirs each step
            made_env = state if env_V is None else eqx.tree_at(
                lambda st: st.components.V, state, env_V)
            _, ci_vjp = self._envelope_vjp(made_env, target.read_activations(
                batch, state.ci_fn.input_names))
            k = cfg.data.train_batch_replay
            g_ci, _ = ci_vjp(jax.tree.map(lambda a, e: (a / k).astype(e.dtype), acc, env))
        lr_c = schedule_value(cfg.decomp.lr_components, step, self.steps)
        g_comp = comp_lib.tie_grads(g_comp, self.ties)
        g_norm_c = global_norm(g_comp)
        g_comp = clip_by_global_norm(g_comp, cfg.decomp.grad_clip_components)
        comps, opt_c = apply_update(state.components, g_comp, state.opt_components, self.opt, lr_c)
        comps = comp_lib.tie(comps, self.ties)

        metrics = {f"train/loss/{k}": v for k, v in parts.items()}
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
                         opt_ci_fn=opt_ci, adversaries=advs)
        return new, jax.lax.stop_gradient(new_env), acc, metrics

    # ------------------------------------------------------------ the variants (SPEC 7)

    def full(self, state: TrainState, target: Target, batch):
        """The plain step (SPEC 6): what `every` runs, bit for bit."""
        new, _, _, metrics = self._step(state, target, batch, None)
        return new, metrics

    def full_keep(self, state: TrainState, target: Target, batch):
        """The plain step, also returning its envelope (`first` at t = 0)."""
        new, env, _, metrics = self._step(state, target, batch, None, keep_env=True)
        return new, env, metrics

    def compute_ci(self, target: Target, state: TrainState, batch) -> Envelope:
        """An envelope from a plain CI forward: no vjp, no update."""
        taps = target.read_activations(batch, state.ci_fn.input_names)
        return jax.lax.stop_gradient(self._envelope(state.ci_fn, state.components, taps))

    def repeat(self, model_env, state: TrainState, batch):
        """[W3] a step on the cached envelope: no taps, no CI fn forward or backward; the CI
        fn and its optimizer state pass through untouched. [W5] `model_env` = (target,
        envelope) is the first argument so donating the others never frees it."""
        target, env = model_env
        new, _, _, metrics = self._step(state, target, batch, env)
        return new, metrics

    def mean_accum(self, model_env, state: TrainState, acc: Envelope, batch):
        """`mean`, t < k-1: a repeat step that adds its envelope cotangent to `acc`."""
        target, env = model_env
        new, _, acc, metrics = self._step(state, target, batch, env, acc)
        return new, acc, metrics

    def mean_update(self, model_env, state: TrainState, acc: Envelope, batch):
        """`mean`, t = k-1: the last repeat step, then ONE CI update with the window mean.
        `model_env` = (target, envelope, the V that made the envelope: None where the CI fn
        does not read V)."""
        target, env, env_V = model_env
        new, _, _, metrics = self._step(state, target, batch, env, acc, update_ci_from_acc=True,
                                        env_V=env_V)
        return new, metrics


def _rows_of(lower, rows: live_lib.Subset | None, env_on_rows: bool):
    """An envelope's lower CI on the recon's rows, and the imp-min row counts of the
    envelope (live_rows.py): on `rows`, either taken from the batch's envelope or the first
    rows of one computed on `rows.take_and_zero_row`."""
    if rows is None:
        return lower, None
    if not env_on_rows:
        return rows.take(lower), None
    return {s: v[:rows.k] for s, v in lower.items()}, rows.counts


def zero_accumulator(env: Envelope) -> Envelope:
    """The fp32 cotangent accumulator of a `mean` window."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), env)
