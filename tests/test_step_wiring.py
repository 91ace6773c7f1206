"""The STEP's wiring of SPEC 4-6, each against its formula written out here.

tests/test_math.py checks the pieces alone (schedule_value, imp_min, clip, faithfulness,
mask_from_source); these tests check that the step and the faithfulness warmup compose them
as SPEC 6 says: the total loss from its logged parts, imp-min at the scheduled p / gamma of the
GLOBAL step [S7, S20], the component and CI-fn AdamW updates with the clip [S19, S20], the
faithfulness warmup [S21] and the stochastic sources [S10]. Every expected value is numpy
(float64) arithmetic on the formula, never the package's helper for the thing under test.
All on the TMS 5-2 target, batch 32, a few steps.
"""

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import config
from ppgd_tpu.config import (ImpMinConfig, PersistentPGDTerm, Schedule, StochasticTerm,
                             TMSConfig, LOSS_PARTS_BESIDE_RECON)
from ppgd_tpu.decomp import ci_fn as ci_lib
from ppgd_tpu.decomp import losses
from ppgd_tpu.decomp.live_rows import Subset
from ppgd_tpu.step import CIRows, Decomposer, Envelope
from ppgd_tpu.targets import tms

B = 32


def _cfg(decomp=None, **loss_kw):
    """TMS 5-2, batch 32, C = 4 per site, 10 steps; `decomp` / `loss_kw` replace whole
    fields (objects: a schedule, a mapping of terms)."""
    cfg = config({"data.batch_size": B, "decomp.steps": 10, "decomp.sites.*": 4})
    return dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, **loss_kw),
                               decomp=dataclasses.replace(cfg.decomp, **(decomp or {})))


@pytest.fixture(scope="module")
def target():
    return tms.init(TMSConfig(), jax.random.key(0))


def _batch(t, seed):
    return t.sample(jax.random.key(seed), B)


def _at_step(state, s):
    return eqx.tree_at(lambda z: z.step, state, jnp.int32(s))


def _np(tree):
    return [np.asarray(x, np.float64) for x in jax.tree.leaves(tree)]


def _sched(kind, value, step, total, warmup=0, final_frac=0.0):
    """[S20] by hand: value*step/warmup during warmup; then progress
    (step - warmup) / (total - warmup - 1), clipped to [0, 1], linear or cosine to
    value*final_frac."""
    if step < warmup:
        return value * step / warmup
    if kind == "constant":
        return value
    progress = min(max((step - warmup) / (total - warmup - 1), 0.0), 1.0)
    end = value * final_frac
    if kind == "linear":
        return value + (end - value) * progress
    return end + (value - end) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _upper_by_hand(logits):
    """[S6] upper = x > 1 ? 1 + 0.01 (x - 1) : clamp(x, 0, 1)."""
    x = np.asarray(logits, np.float64)
    return np.where(x > 1, 1.0 + 0.01 * (x - 1.0), np.clip(x, 0.0, 1.0))


class _AdamW:
    """AdamW by hand, float64: beta (0.9, 0.999), eps 1e-8 outside the sqrt, bias correction
    with the update count t, decoupled weight decay p -= lr * wd * p [S20]."""

    def __init__(self, params, wd):
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]
        self.t = 0
        self.wd = wd

    def step(self, params, grads, lr):
        self.t += 1
        out = []
        for i, (p, g) in enumerate(zip(params, grads)):
            self.m[i] = 0.9 * self.m[i] + 0.1 * g
            self.v[i] = 0.999 * self.v[i] + 0.001 * g * g
            m_hat = self.m[i] / (1 - 0.9 ** self.t)
            v_hat = self.v[i] / (1 - 0.999 ** self.t)
            out.append(p - lr * (m_hat / (np.sqrt(v_hat) + 1e-8) + self.wd * p))
        return out


# ---------------------------------------------------------------- SPEC 6 loss composition


def test_SPEC6_total_is_faith_coeff_faithfulness_plus_imp_min_plus_coeff_weighted_terms(target):
    """L = faith_coeff * faithfulness + imp terms + Σ_t coeff_t * term_t, from the logged
    parts, with non-default coefficients on two stochastic terms and a persistent one."""
    coeffs = {"st": 1.3, "lw": 0.4, "pp": 2.0}
    cfg = _cfg(faithfulness_coeff=0.7,
               imp_min=ImpMinConfig(coeff=0.05, p=Schedule("linear", 2.0, final_frac=0.2)),
               stochastic={"st": StochasticTerm(coeff=coeffs["st"]),
                           "lw": StochasticTerm(coeff=coeffs["lw"], plan="chunked")},
               persistent_pgd={"pp": PersistentPGDTerm(coeff=coeffs["pp"], scope="bsc",
                                                       n_warmup=1)})
    dec = Decomposer(cfg, target, (B, 5))
    state = _at_step(dec.init(target), 4)
    _, m = jax.jit(dec.full)(state, target, _batch(target, 5))
    m = {k: float(v) for k, v in m.items()}
    # config refuses recon term names that clash with the other parts the step logs
    parts = {k.removeprefix("train/loss/") for k in m if k.startswith("train/loss/")}
    assert parts == set(coeffs) | LOSS_PARTS_BESIDE_RECON
    total = 0.7 * m["train/loss/faithfulness"] + m["train/loss/imp_min"] + sum(
        c * m[f"train/loss/{n}"] for n, c in coeffs.items())
    assert m["train/loss/total"] == pytest.approx(total, rel=1e-6)
    # every part carries weight in the total: a wrong coefficient on any would show
    for part in [0.7 * m["train/loss/faithfulness"], m["train/loss/imp_min"]] + [
            c * m[f"train/loss/{n}"] for n, c in coeffs.items()]:
        assert part > 1e-5 * total


# ---------------------------------------------------------------- [S7] imp-min in the step


@pytest.mark.parametrize("kind,p,gamma", [
    ("lp", ("linear", 2.0, 0, 0.2), None),
    ("lp", ("cosine", 1.5, 2, 0.3), None),
    ("smooth_l0", None, ("cosine", 0.3, 2, 0.1)),
    ("smooth_l0", None, ("linear", 0.5, 0, 0.2)),
])
def test_S7_S20_step_imp_min_is_psi_of_upper_at_the_global_step_schedule(target, kind, p, gamma):
    """The logged imp-min at global step s = imp_coeff * Σ_sites Σ_c mean_batch ψ(upper),
    ψ = (u + 1e-12)^p(s) or u² / (u² + γ(s)²), p(s) / γ(s) from the [S20] formula with the
    `decay_steps - 1` denominator (steps 12, global step 7, the optimizer count 0)."""
    steps, s, coeff = 12, 7, 0.05
    imp = ImpMinConfig(coeff=coeff, kind=kind)
    if p is not None:
        imp = dataclasses.replace(imp, p=Schedule(p[0], p[1], warmup_steps=p[2], final_frac=p[3]))
    if gamma is not None:
        imp = dataclasses.replace(imp, gamma=Schedule(gamma[0], gamma[1], warmup_steps=gamma[2],
                                                      final_frac=gamma[3]))
    cfg = _cfg(decomp={"steps": steps}, imp_min=imp, stochastic={"st": StochasticTerm()})
    dec = Decomposer(cfg, target, (B, 5))
    state = _at_step(dec.init(target), s)
    x = _batch(target, 5)
    _, m = jax.jit(dec.full)(state, target, x)

    taps = target.read_activations(x, state.ci_fn.input_names)
    upper = {k: _upper_by_hand(v) for k, v in state.ci_fn(taps, state.components).items()}

    def by_hand(sched_args, at_step, denom_shift=0):
        kind_, value, warmup, frac = sched_args
        # denom_shift=1 is the wrong denominator `decay_steps`: the test must tell them apart
        return _sched(kind_, value, at_step, steps + denom_shift, warmup, frac)

    def imp_min(param):
        total = 0.0
        for u in upper.values():
            psi = (u + 1e-12) ** param if kind == "lp" else u ** 2 / (u ** 2 + param ** 2)
            total += np.sum(np.mean(psi, axis=0))
        return coeff * total

    sched = p if kind == "lp" else gamma
    want = imp_min(by_hand(sched, s))
    got = float(m["train/loss/imp_min"])
    assert got == pytest.approx(want, rel=2e-6)
    # discriminating: the wrong denominator, the step before, or the unscheduled peak all
    # give values far outside the tolerance
    for wrong in (by_hand(sched, s, denom_shift=1), by_hand(sched, s - 1), sched[1]):
        assert abs(imp_min(wrong) - want) > 1e-4 * want


# ---------------------------------------------------------------- [S19, S20] the updates


def test_S19_S20_step_updates_are_clipped_adamw_at_the_global_step_lrs(target):
    """Three steps from global step 3 (optimizer count 0) against AdamW by hand: the
    gradient of the total loss w.r.t. the components (CI path into V included: the
    per-component CI fn reads x @ V) clipped with scale min(1, clip / (‖g‖ + 1e-6)), then
    Adam (0.9, 0.999, eps 1e-8, bias correction at the update count), decoupled weight decay,
    at lr_components(s); the CI fn the same without the clip at lr_ci_fn(s). Small loss
    coefficients keep ‖g‖ ~ 1e-4, where the +1e-6 moves the clip scale by ~1%."""
    s0, n, wd, clip = 3, 3, 0.1, 1e-7
    lr_c = ("cosine", 0.05, 2, 0.1)  # warmup 2: the steps 3..5 are past it
    lr_f = ("linear", 0.04, 0, 0.25)
    cfg = _cfg(decomp={"weight_decay": wd, "grad_clip_components": clip,
                       "lr_components": Schedule(lr_c[0], lr_c[1], lr_c[2], lr_c[3]),
                       "lr_ci_fn": Schedule(lr_f[0], lr_f[1], lr_f[2], lr_f[3])},
               faithfulness_coeff=1e-4, imp_min=ImpMinConfig(coeff=1e-5),
               stochastic={"st": StochasticTerm(coeff=2e-4)})
    dec = Decomposer(cfg, target, (B, 5))
    assert getattr(dec.init(target).ci_fn, "grads_into_components", False)
    state = _at_step(dec.init(target), s0)
    step_fn = jax.jit(dec.full)

    @jax.jit
    def grads(comps, ci_fn, x, s):
        taps = target.read_activations(x, ci_fn.input_names)
        every = Subset.all(x.shape[0])

        def total(c, f):
            ci = ci_lib.ci_from_logits(f(taps, c))
            return dec._losses(dec._inputs(s, target, x), every, CIRows(every.take, None), c,
                               {}, Envelope(ci.lower, ci.upper))[0]

        return jax.grad(total, argnums=(0, 1))(comps, ci_fn)

    tree_c = jax.tree.structure(state.components)
    tree_f = jax.tree.structure(state.ci_fn)
    hand_c, hand_f = _np(state.components), _np(state.ci_fn)
    opt_c, opt_f = _AdamW(hand_c, wd), _AdamW(hand_f, wd)
    for k in range(n):
        s = s0 + k
        x = _batch(target, 10 + k)
        prev_c, prev_f = hand_c, hand_f
        g_c, g_f = grads(jax.tree.unflatten(tree_c, [jnp.float32(p) for p in hand_c]),
                         jax.tree.unflatten(tree_f, [jnp.float32(p) for p in hand_f]),
                         x, jnp.int32(s))
        g_c, g_f = _np(g_c), _np(g_f)
        norm = math.sqrt(sum(np.sum(g * g) for g in g_c))
        scale = min(1.0, clip / (norm + 1e-6))
        assert scale < 0.5 and 1e-6 / norm > 5e-3  # the clip engages; its +1e-6 matters
        hand_c = opt_c.step(hand_c, [g * scale for g in g_c],
                            _sched(*lr_c[:2], s, cfg.decomp.steps, *lr_c[2:]))
        hand_f = opt_f.step(hand_f, g_f, _sched(*lr_f[:2], s, cfg.decomp.steps, *lr_f[2:]))

        state, m = step_fn(state, target, x)
        assert int(state.step) == s + 1
        assert float(m["train/grad_norms/summary/components"]) == pytest.approx(norm, rel=1e-5)
        for name, got, want, prev in (("components", _np(state.components), hand_c, prev_c),
                                      ("ci_fn", _np(state.ci_fn), hand_f, prev_f)):
            for a, b, p0 in zip(got, want, prev):
                # the update itself (new - old, ~lr), not the params it is small against;
                # fp32 leaves ~2e-5 of it (optax's 1 - 0.999^t in fp32 alone is off 1.3e-5)
                np.testing.assert_allclose(a - p0, b - p0, rtol=1e-4, atol=1e-6,
                                           err_msg=f"{name} at step {s}")


# ---------------------------------------------------------------- [S21] faithfulness warmup


def _faithfulness_grads(V, U, W):
    """∂/∂V, ∂/∂U of Σ_s ‖W_s − V_s U_s‖² / Σ_s numel(W_s) [S17]."""
    N = sum(w.size for w in W.values())
    R = {s: W[s] - V[s] @ U[s] for s in W}
    return ({s: -2.0 * R[s] @ U[s].T / N for s in W}, {s: -2.0 * V[s].T @ R[s] / N for s in W})


@pytest.mark.parametrize("tie", [{}, {"linear2": "linear1"}])
def test_S21_faithfulness_warmup_is_n_adamw_steps_on_faithfulness_alone(target, tie):
    """n AdamW steps at faithfulness_warmup_lr / _weight_decay on ∇faithfulness from the init
    components (not at the main lr / weight decay, set apart here). With a tie, linear2 stays
    linear1 transposed and its gradient (transposed) adds onto linear1's. (That sum cannot
    be told from linear1's gradient alone here: faithfulness's tied half is its source's
    transposed, so the sum is 2x the source's, and Adam is blind to scale with |g| >> eps.)"""
    n, lr, wd = 6, 0.02, 0.3
    cfg = _cfg(decomp={"faithfulness_warmup_steps": n, "faithfulness_warmup_lr": lr,
                       "faithfulness_warmup_weight_decay": wd, "tie": tie,
                       "lr_components": Schedule("constant", 0.5), "weight_decay": 0.7})
    dec = Decomposer(cfg, target, (B, 5))
    s0 = dec.init(target)
    got = dec.faithfulness_warmup(s0, target)

    W = {s: np.asarray(w, np.float64) for s, w in target.site_weights().items()}
    V = {s: np.asarray(v, np.float64) for s, v in s0.components.V.items()}
    U = {s: np.asarray(u, np.float64) for s, u in s0.components.U.items()}
    trained = [s for s in W if s not in tie]
    opt = _AdamW([x for s in trained for x in (V[s], U[s])], wd)
    for _ in range(n):
        gV, gU = _faithfulness_grads(V, U, W)
        for t, src in tie.items():
            gU[src] = gU[src] + gV[t].T
            gV[src] = gV[src] + gU[t].T
        new = opt.step([x for s in trained for x in (V[s], U[s])],
                       [x for s in trained for x in (gV[s], gU[s])], lr)
        for i, s in enumerate(trained):
            V[s], U[s] = new[2 * i], new[2 * i + 1]
        for t, src in tie.items():
            V[t], U[t] = U[src].T, V[src].T
    for s in W:
        for name, a, b, a0 in (("V", got.components.V[s], V[s], s0.components.V[s]),
                               ("U", got.components.U[s], U[s], s0.components.U[s])):
            a, a0 = np.asarray(a, np.float64), np.asarray(a0, np.float64)
            # the change from init (~n lr), not the params it is small against (as above)
            np.testing.assert_allclose(a - a0, b - a0, rtol=1e-4, atol=1e-6,
                                       err_msg=f"{name}[{s}]")
    assert int(got.step) == 0


# ---------------------------------------------------------------- [S10] stochastic sources


def _sources(key, C, rows, sites, n_draws=1):
    """The sources a stochastic term draws at `key`, by the step's own path (stochastic_recon:
    fold_in(entry), fold_in(draw), then a fold_in per site), recovered from its masks: with
    lower = 0, mask = source[:, :C] and delta = source[:, C] exactly.
    -> [draw][site] float64 [rows, C + 1]."""
    captured = []

    def capture(masks):
        draw = {}
        for s, thunk in masks.items():
            sm = thunk()
            draw[s] = np.concatenate([np.asarray(sm.mask, np.float64),
                                      np.asarray(sm.delta, np.float64)[:, None]], axis=1)
        captured.append(draw)
        return jnp.float32(0.0)

    lower = {s: jnp.zeros((rows, C)) for s in sites}
    losses.stochastic_recon(key, StochasticTerm(n_draws=n_draws), [tuple(sites)], lower, capture,
                            use_delta=True, rows=Subset.all(rows))
    assert len(captured) == n_draws
    return captured


def _step_key(seed, step, term_index=0):
    """[R1] the key of stochastic term `term_index` at global `step` (step.py's index 1000)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), 1000 + term_index)


def test_S10_stochastic_sources_are_fresh_uniform_per_site_row_and_channel():
    """Over 2^17 rows: every source in [0, 1); per site and channel mean 1/2, variance 1/12
    and P(u < 1/4) = 1/4 within 6 standard errors of the uniform's; uncorrelated across
    channels, sites, draws and steps; the same key gives the same bits."""
    rows, C, sites = 1 << 17, 4, ("linear1", "linear2")
    key = _step_key(0, 4)
    a = _sources(key, C, rows, sites, n_draws=2)
    again = _sources(key, C, rows, sites, n_draws=2)
    nxt = _sources(_step_key(0, 5), C, rows, sites, n_draws=1)

    se_mean = math.sqrt(1 / 12 / rows)
    se_var = math.sqrt((1 / 80 - 1 / 144) / rows)  # Var[(u - 1/2)^2] = 1/80 - 1/144
    se_q = math.sqrt(0.25 * 0.75 / rows)
    se_corr = 1 / math.sqrt(rows)
    for d in range(2):
        for s in sites:
            u = a[d][s]
            assert u.shape == (rows, C + 1)
            assert u.min() >= 0.0 and u.max() < 1.0
            assert np.all(np.abs(u.mean(0) - 0.5) < 6 * se_mean)
            assert np.all(np.abs(u.var(0) - 1 / 12) < 6 * se_var)
            assert np.all(np.abs((u < 0.25).mean(0) - 0.25) < 6 * se_q)
            corr = np.corrcoef(u.T)[np.triu_indices(C + 1, 1)]  # channels of one site
            assert np.all(np.abs(corr) < 6 * se_corr)
            # deterministic for the same key
            np.testing.assert_array_equal(u, again[d][s])
            # neighbouring rows are not copies
            assert abs(np.corrcoef(u[:-1, 0], u[1:, 0])[0, 1]) < 6 * se_corr
    pairs = [(a[0]["linear1"], a[0]["linear2"]),  # two sites, one draw
             (a[0]["linear1"], a[1]["linear1"]),  # two draws, one site
             (a[0]["linear1"], nxt[0]["linear1"])]  # two steps
    for u, w in pairs:
        assert not np.any(np.all(u == w, axis=0))
        for c in range(C + 1):
            assert abs(np.corrcoef(u[:, c], w[:, c])[0, 1]) < 6 * se_corr


def test_S10_step_stochastic_term_is_the_mean_mse_over_draws_of_masks_from_those_sources(target):
    """The logged term at global step s is the mean over its n_draws forwards of the MSE
    against the clean output, each forward on masks lower + (1 - lower) src[:, :C], delta mask
    src[:, C], from the sources the path above draws with the step's key — by hand on TMS:
    x_hat = relu(site(linear2, site(linear1, x)) + b), site = ((h V) * mask) U + (h Δ) d."""
    s, C = 6, 4
    cfg = _cfg(stochastic={"st": StochasticTerm(coeff=1.0, n_draws=3)})
    dec = Decomposer(cfg, target, (B, 5))
    state = _at_step(dec.init(target), s)
    x = _batch(target, 7)
    _, m = jax.jit(dec.full)(state, target, x)

    taps = target.read_activations(x, state.ci_fn.input_names)
    logits = state.ci_fn(taps, state.components)
    lower = {k: np.clip(np.asarray(v, np.float64), 0.0, 1.0) for k, v in logits.items()}
    W = {k: np.asarray(w, np.float64) for k, w in target.site_weights().items()}
    V = {k: np.asarray(v, np.float64) for k, v in state.components.V.items()}
    U = {k: np.asarray(u, np.float64) for k, u in state.components.U.items()}
    b = np.asarray(target.b, np.float64)
    xn = np.asarray(x, np.float64)
    clean = np.maximum(xn @ W["linear1"] @ W["linear2"] + b, 0.0)

    draws = _sources(_step_key(cfg.seed, s), C, B, dec.sites, n_draws=3)
    divs = []
    for src in draws:
        h = xn
        for site in ("linear1", "linear2"):
            mask = lower[site] + (1 - lower[site]) * src[site][:, :C]
            d = src[site][:, C:]
            h = ((h @ V[site]) * mask) @ U[site] + (h @ (W[site] - V[site] @ U[site])) * d
        divs.append(np.mean((np.maximum(h + b, 0.0) - clean) ** 2))
    assert float(m["train/loss/st"]) == pytest.approx(np.mean(divs), rel=1e-5)
    assert np.std(divs) > 1e-3 * np.mean(divs)  # the draws differ: their mean is what counts
