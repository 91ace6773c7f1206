"""One test per SPEC invariant of the decomposition math, each against its formula."""

import dataclasses
import functools
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import config
from ppgd_tpu.config import ImpMinConfig, PersistentPGDTerm, Schedule, StochasticTerm
from ppgd_tpu.decomp import adversary, ci_fn, component_mlp, components, losses, rng, schedules
from ppgd_tpu.decomp.divergence import kl
from ppgd_tpu.decomp.live_rows import Subset
from ppgd_tpu.targets import resid_mlp, tms
from ppgd_tpu.targets.base import SiteMask

jax.config.update("jax_enable_x64", False)


# ---------------------------------------------------------------- [S6] squashings


def _grad_lower(x, g):
    _, vjp = jax.vjp(ci_fn.lower_leaky_hard, jnp.float32(x))
    return float(vjp(jnp.float32(g))[0])


@pytest.mark.parametrize("x,g,expected", [
    (0.5, 2.0, 2.0),     # inside (0, 1]: g
    (1.0, 2.0, 2.0),     # x = 1 belongs to the inside branch
    (1.5, 2.0, 0.0),     # above 1: 0
    (1.5, -2.0, 0.0),
    (-0.5, -2.0, -0.02),  # below 0, g < 0: 0.01 g
    (-0.5, 2.0, 0.0),    # below 0, g >= 0: 0
    (0.0, -2.0, -0.02),  # the tie x = 0 belongs to the x <= 0 branch
    (0.0, 2.0, 0.0),
])
def test_S6_lower_leaky_hard_backward(x, g, expected):
    assert _grad_lower(x, g) == pytest.approx(expected, abs=1e-7)


def test_S6_lower_forward_is_clamp_and_upper_is_leaky_above_one():
    x = jnp.array([-2.0, 0.0, 0.3, 1.0, 3.0])
    np.testing.assert_allclose(ci_fn.lower_leaky_hard(x), [0, 0, 0.3, 1, 1])
    np.testing.assert_allclose(ci_fn.upper_leaky_hard(x), [0, 0, 0.3, 1, 1.02], rtol=1e-6)
    # ordinary autodiff: slope 0.01 above 1, 1 inside, 0 below
    g = jax.vmap(jax.grad(ci_fn.upper_leaky_hard))(jnp.array([-1.0, 0.5, 2.0]))
    np.testing.assert_allclose(g, [0.0, 1.0, 0.01], rtol=1e-6)


def test_S5_ci_from_logits_is_the_one_constructor():
    logits = {"a": jnp.array([[-1.0, 0.5, 2.0]])}
    ci = ci_fn.ci_from_logits(logits)
    np.testing.assert_array_equal(ci.lower["a"], ci_fn.lower_leaky_hard(logits["a"]))
    np.testing.assert_array_equal(ci.upper["a"], ci_fn.upper_leaky_hard(logits["a"]))


# ---------------------------------------------------------------- [S20] schedules, [S19] clip


def test_S20_cosine_reaches_final_value_at_last_step():
    s = Schedule("cosine", 1.0, warmup_steps=10, final_frac=0.1)
    total = 110
    assert float(schedules.schedule_value(s, 10, total)) == pytest.approx(1.0)
    assert float(schedules.schedule_value(s, total - 1, total)) == pytest.approx(0.1, abs=1e-6)
    mid = 10 + (total - 10 - 1) / 2  # progress 0.5 -> halfway between peak and end
    assert float(schedules.schedule_value(s, mid, total)) == pytest.approx(0.55, abs=1e-6)
    # warmup: value * step / warmup
    assert float(schedules.schedule_value(s, 5, total)) == pytest.approx(0.5)
    assert float(schedules.schedule_value(s, 0, total)) == 0.0


def test_S20_linear_schedule_endpoints():
    s = Schedule("linear", 2.0, final_frac=0.2)  # p: 2.0 -> 0.4
    assert float(schedules.schedule_value(s, 0, 50)) == pytest.approx(2.0)
    assert float(schedules.schedule_value(s, 49, 50)) == pytest.approx(0.4)
    assert float(schedules.schedule_value(s, 1000, 50)) == pytest.approx(0.4)


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_S20_one_decay_step_is_the_last_step_and_takes_the_final_value(kind):
    """decay_steps = 1 (steps = warmup + 1): the [S20] denominator decay_steps - 1 is 0, and
    the one decay step is step = steps - 1, where the final value is reached."""
    s = Schedule(kind, 2.0, warmup_steps=4, final_frac=0.1)
    assert [float(schedules.schedule_value(s, i, 5)) for i in range(5)] == pytest.approx(
        [0.0, 0.5, 1.0, 1.5, 0.2])
    one = Schedule(kind, 2.0, final_frac=0.1)  # a one-step run
    assert float(schedules.schedule_value(one, 0, 1)) == pytest.approx(0.2)


def test_S19_clip_scale_includes_1e_minus_6():
    g = {"a": jnp.array([3.0, 4.0])}  # norm 5
    out = schedules.clip_by_global_norm(g, 0.01)
    scale = min(1.0, 0.01 / (5.0 + 1e-6))
    np.testing.assert_allclose(out["a"], np.array([3.0, 4.0]) * scale, rtol=1e-7)
    # below the threshold the scale is still min(1, max/(norm+1e-6)) = 1
    small = {"a": jnp.array([1e-4, 0.0])}
    np.testing.assert_allclose(schedules.clip_by_global_norm(small, 0.01)["a"], [1e-4, 0.0])
    # exactly at the threshold the +1e-6 makes the scale < 1
    at = {"a": jnp.array([0.01, 0.0])}
    assert float(schedules.clip_by_global_norm(at, 0.01)["a"][0]) == pytest.approx(
        0.01 * 0.01 / (0.01 + 1e-6), rel=1e-6)


# ---------------------------------------------------------------- [S25] KL, [S17] faithfulness


def test_S25_kl_direction_is_clean_p_against_masked_q():
    rng = np.random.default_rng(0)
    clean = rng.normal(size=(3, 4, 7)).astype(np.float32)
    masked = rng.normal(size=(3, 4, 7)).astype(np.float32)
    p = np.exp(clean) / np.exp(clean).sum(-1, keepdims=True)
    q = np.exp(masked) / np.exp(masked).sum(-1, keepdims=True)
    expected = np.mean(np.sum(p * (np.log(p) - np.log(q)), -1))
    reverse = np.mean(np.sum(q * (np.log(q) - np.log(p)), -1))
    got = float(kl(jnp.asarray(clean), jnp.asarray(masked)))
    assert got == pytest.approx(expected, rel=1e-5)
    assert abs(got - reverse) > 1e-3  # the direction matters


def test_S17_faithfulness_formula():
    rng = np.random.default_rng(1)
    W = {"a": rng.normal(size=(4, 3)), "b": rng.normal(size=(3, 5))}
    V = {"a": rng.normal(size=(4, 2)), "b": rng.normal(size=(3, 6))}
    U = {"a": rng.normal(size=(2, 3)), "b": rng.normal(size=(6, 5))}
    comps = components.Components(V={k: jnp.asarray(v, jnp.float32) for k, v in V.items()},
                                  U={k: jnp.asarray(v, jnp.float32) for k, v in U.items()})
    expected = sum(np.sum((W[s] - V[s] @ U[s]) ** 2) for s in W) / (12 + 15)
    got = components.faithfulness(comps, {k: jnp.asarray(v, jnp.float32) for k, v in W.items()})
    assert float(got) == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------- [S7, S8] imp-min


def test_S7_S8_imp_min_lp_and_frequency_term():
    rng = np.random.default_rng(2)
    upper = {"a": rng.uniform(0, 1.2, size=(6, 3)), "b": rng.uniform(0, 1, size=(6, 4))}
    p, a, eps = 0.7, 50.0, 1e-12
    cfg = ImpMinConfig(coeff=0.3, kind="lp", eps=eps, freq_coeff=0.2, reference_token_count=a)
    f = {s: np.sum((u + eps) ** p, axis=0) / u.shape[0] for s, u in upper.items()}
    lp = sum(fs.sum() for fs in f.values())
    freq = sum(np.sum(fs * np.log2(1 + a * fs)) for fs in f.values())
    got, got_lp, got_freq = losses.imp_min({s: jnp.asarray(u, jnp.float32) for s, u in upper.items()},
                                           cfg, p, 0.1)
    assert float(got_lp) == pytest.approx(lp, rel=1e-5)
    assert float(got_freq) == pytest.approx(freq, rel=1e-5)
    assert float(got) == pytest.approx(0.3 * lp + 0.2 * freq, rel=1e-5)


def test_S7_S8_imp_min_with_row_counts_is_imp_min_of_the_repeated_rows():
    """A row standing for `counts[r]` identical batch rows (live_rows.py's zero row) gives
    the imp-min, lp and frequency term of the batch with those rows repeated."""
    u = np.random.default_rng(4).uniform(0, 1.2, size=(5, 3)).astype(np.float32)
    counts = np.array([1, 1, 1, 1, 7], np.float32)
    for cfg in (ImpMinConfig(coeff=0.3, p=Schedule("constant", 0.7), freq_coeff=0.2,
                             reference_token_count=50.0),
                ImpMinConfig(coeff=1.0, kind="smooth_l0")):
        got = losses.imp_min({"a": jnp.asarray(u)}, cfg, 0.7, 0.2, counts)
        want = losses.imp_min({"a": jnp.asarray(np.repeat(u, counts.astype(int), 0))}, cfg,
                              0.7, 0.2)
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_S7_imp_min_smooth_l0_and_positions_over_leading_axes():
    u = np.random.default_rng(3).uniform(0, 1, size=(2, 5, 3))  # [B, T, C]
    gamma = 0.2
    cfg = ImpMinConfig(coeff=1.0, kind="smooth_l0")
    psi = u ** 2 / (u ** 2 + gamma ** 2)
    expected = np.sum(psi.reshape(-1, 3).sum(0) / 10)
    got, _, _ = losses.imp_min({"a": jnp.asarray(u, jnp.float32)}, cfg, 1.0, gamma)
    assert float(got) == pytest.approx(expected, rel=1e-5)


# ---------------------------------------------------------------- [S2] masked forward


@pytest.fixture(scope="module")
def small_tms():
    from ppgd_tpu.config import TMSConfig

    t = tms.init(TMSConfig(n_features=5, n_hidden=2, n_identity_layers=1), jax.random.key(0))
    C = {s: 3 for s in t.site_names}
    comps = components.init(jax.random.key(1), t.site_weights(), C)
    x = t.sample(jax.random.key(2), 16)
    return t, comps, x


def test_S2_no_live_sites_is_bit_identical_to_clean(small_tms):
    t, comps, x = small_tms
    np.testing.assert_array_equal(t.masked_forward(x, comps, {}), t.clean_output(x))


def test_S2_route_nowhere_equals_frozen_and_non_live_sites_get_no_gradient(small_tms):
    t, comps, x = small_tms
    B = x.shape[0]
    m = SiteMask(jnp.full((B, 3), 0.3), jnp.full((B,), 0.5), jnp.zeros((B,), bool))
    np.testing.assert_allclose(t.masked_forward(x, comps, {"linear1": m}), t.clean_output(x),
                               rtol=1e-6)

    def loss(c):
        return jnp.sum(t.masked_forward(x, c, {"linear1": m._replace(route=None)}))

    g = jax.grad(loss)(comps)
    assert float(jnp.abs(g.V["linear1"]).sum()) > 0
    assert float(jnp.abs(g.V["linear2"]).sum()) == 0  # non-live: frozen path only
    assert float(jnp.abs(g.U["hidden_layers.0"]).sum()) == 0


def test_S2_site_out_formula_and_ones_with_delta_match_clean(small_tms):
    t, comps, x = small_tms
    B = x.shape[0]
    V, U = comps.V["linear1"], comps.U["linear1"]
    rng = np.random.default_rng(4)
    mask = jnp.asarray(rng.uniform(size=(B, 3)), jnp.float32)
    dm = jnp.asarray(rng.uniform(size=(B,)), jnp.float32)
    seen = {}

    def capture(name, h, W_):
        seen[name] = h
        return h @ W_

    t.forward(x, capture)
    h = t.masked_forward(x, comps, {"linear1": SiteMask(mask, dm)})
    x1 = seen["linear1"]
    deltas = t.weight_deltas(comps)  # the Target API's Δ_s = W_s − V_s U_s (SPEC 1)
    assert sorted(deltas) == sorted(t.site_weights())
    for s, Ws in t.site_weights().items():
        np.testing.assert_allclose(deltas[s], Ws - comps.V[s] @ comps.U[s], rtol=1e-6)
    by_hand = ((x1 @ V) * mask) @ U + (x1 @ deltas["linear1"]) * dm[:, None]
    expected = t.forward(x, lambda n, hh, WW: by_hand if n == "linear1" else hh @ WW)
    np.testing.assert_allclose(h, expected, rtol=1e-5, atol=1e-6)
    ones = {s: SiteMask(jnp.ones((B, 3)), jnp.ones((B,)), jnp.ones((B,), bool))
            for s in t.site_names}
    np.testing.assert_allclose(t.masked_forward(x, comps, ones), t.clean_output(x),
                               rtol=1e-5, atol=1e-5)


def test_S3_the_recon_target_is_the_frozen_forward_not_the_all_ones_masked_path(small_tms):
    """clean_output is `forward` with every site x @ W, gradient-stopped; without the delta
    channel, masks of all ones give V U, which differs from W before training."""
    t, comps, x = small_tms
    np.testing.assert_array_equal(t.clean_output(x), t.forward(x, lambda n, h, W: h @ W))
    g = jax.grad(lambda tg: jnp.sum(tg.clean_output(x) ** 2))(t)
    assert all(float(jnp.abs(w).sum()) == 0 for w in jax.tree.leaves(g))
    B = x.shape[0]
    ones = {s: SiteMask(jnp.ones((B, 3))) for s in t.site_names}
    all_ones = t.masked_forward(x, comps, ones)
    vu = t.forward(x, lambda n, h, W: h @ comps.V[n] @ comps.U[n])
    np.testing.assert_allclose(all_ones, vu, rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(all_ones - t.clean_output(x)))) > 1e-3


# ---------------------------------------------------------------- [S10, S11] stochastic plans


def test_S11_uniform_k_routes_k_sites_per_position_uniformly():
    routes = losses.uniform_k_routes(jax.random.key(0), (20000,), 4)
    counts = np.asarray(routes).sum(0)
    assert counts.min() >= 1 and counts.max() <= 4
    freq = np.bincount(counts, minlength=5)[1:] / counts.size
    np.testing.assert_allclose(freq, 0.25, atol=0.02)  # k ~ U{1..4}
    # given k, each k-subset is equally likely (each site being in half of them is not
    # enough: a cyclic run of k sites has that too, and never routes {0, 2} or {1, 3})
    pairs = np.asarray(routes)[:, counts == 2].T
    codes, n = np.unique(pairs @ (1 << np.arange(4)), return_counts=True)
    assert sorted(codes) == [3, 5, 6, 9, 10, 12]
    np.testing.assert_allclose(n / n.sum(), 1 / 6, atol=0.02)
    # [B, T] leading axes: a draw per position, not one per row
    grid = np.asarray(losses.uniform_k_routes(jax.random.key(1), (64, 32), 4)).sum(0)
    assert grid.shape == (64, 32)
    assert np.mean([len(set(row)) > 1 for row in grid]) > 0.9
    np.testing.assert_allclose(np.bincount(grid.ravel(), minlength=5)[1:] / grid.size, 0.25,
                               atol=0.03)


def test_S10_plans_and_mean_over_all_forwards():
    sites = ("a", "b", "c", "d", "e")
    assert losses.stochastic_plan(StochasticTerm(plan="all"), sites) == [sites]
    assert losses.stochastic_plan(StochasticTerm(plan="chunked", chunk_size=2), sites) == [
        ("a", "b"), ("c", "d"), ("e",)]
    lower = {s: jnp.zeros((4, 2)) for s in sites}
    calls = []

    def recon(masks):
        calls.append(tuple(masks))
        return jnp.float32(len(masks))  # divergence = number of live sites

    term = StochasticTerm(plan="chunked", chunk_size=2, n_draws=3)
    out = losses.stochastic_recon(jax.random.key(0), term, losses.stochastic_plan(term, sites),
                                  lower, recon, True, Subset.all(4))
    assert len(calls) == 9
    assert float(out) == pytest.approx((2 + 2 + 1) / 3)


def test_mask_from_source_formula():
    lower = jnp.array([[0.2, 0.9]])
    src = jnp.array([[0.5, 0.0, 0.7]])
    m = losses.mask_from_source(lower, src, use_delta=True)
    np.testing.assert_allclose(m.mask, [[0.2 + 0.8 * 0.5, 0.9]])
    np.testing.assert_allclose(m.delta, [0.7])
    assert losses.mask_from_source(lower, src, use_delta=False).delta is None


# ---------------------------------------------------------------- [S15] adversary


def test_S15_ascend_is_adam_ascent_with_eps_outside_sqrt_and_bias_correction():
    cfg = PersistentPGDTerm(beta1=0.9, beta2=0.99, eps=1e-3)
    adv = adversary.init(jax.random.key(0), "sc", (4,), {"a": 2})
    src0 = np.asarray(adv.sources["a"])
    g1 = np.array([[0.5, -0.2, 0.1]], np.float32)
    g2 = np.array([[-0.1, 0.3, 0.0]], np.float32)
    lr = 0.05
    a = adversary.ascend(adv, {"a": jnp.asarray(g1)}, cfg, lr)
    a = adversary.ascend(a, {"a": jnp.asarray(g2)}, cfg, lr)
    m, v, s = np.zeros_like(g1), np.zeros_like(g1), src0.copy()
    for t, g in enumerate([g1, g2], start=1):
        m = 0.9 * m + 0.1 * g
        v = 0.99 * v + 0.01 * g * g
        s = np.clip(s + lr * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.99 ** t)) + 1e-3), 0, 1)
    np.testing.assert_allclose(a.sources["a"], s, rtol=1e-5)
    assert float(a.step_count) == 2.0
    # eps inside the sqrt would give a different value
    wrong = np.clip(src0 + lr * (0.1 * g1 / 0.1) / np.sqrt(0.01 * g1 ** 2 / 0.01 + 1e-3), 0, 1)
    assert not np.allclose(
        adversary.ascend(adv, {"a": jnp.asarray(g1)}, cfg, lr).sources["a"], wrong)




@pytest.mark.parametrize("n", [1, 3])
def test_S15_idle_ascents_are_ascents_with_a_zero_gradient(n):
    """live_rows.py: the rows outside a step's live subset take n_warmup + 1 zero-gradient
    Adam steps in one pass (one sqrt, one clamp); the formula's sources, moments and count,
    with sources pushed past both clamps and moments of both signs."""
    cfg = PersistentPGDTerm(beta1=0.9, beta2=0.99, eps=1e-3)
    m0 = np.array([[0.4, -0.3, 0.02, 0.0, -1e-4, 2.0]], np.float32)
    v0 = np.array([[0.01, 0.02, 1e-6, 0.0, 1e-9, 0.5]], np.float32)
    s0 = np.array([[0.99, 0.01, 0.5, 0.3, 0.2, 0.0]], np.float32)
    adv = adversary.Adversary({"a": jnp.asarray(s0)}, {"a": jnp.asarray(m0)},
                              {"a": jnp.asarray(v0)}, jnp.float32(4.0), "bsc")
    lr = 0.05
    got = adversary.idle_ascents(adv, n, cfg, lr)
    m, v, s = m0.astype(np.float64), v0.astype(np.float64), s0.astype(np.float64)
    for t in range(5, 5 + n):
        m, v = 0.9 * m, 0.99 * v
        s = np.clip(s + lr * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.99 ** t)) + 1e-3), 0, 1)
    assert s[0, 0] == 1.0 and s[0, 1] == 0.0  # the clamps were reached
    np.testing.assert_allclose(got.sources["a"], s, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(got.m["a"], m, rtol=1e-6)
    np.testing.assert_allclose(got.v["a"], v, rtol=1e-6)
    assert float(got.step_count) == 4.0 + n
def test_adversary_scope_shapes():
    """SPEC 5: `sc` one source shared across the batch (per position), `bsc` one per row."""
    assert adversary.scope_shape("sc", (8,)) == (1,)
    assert adversary.scope_shape("bsc", (8,)) == (8,)
    assert adversary.scope_shape("sc", (8, 16)) == (1, 16)
    assert adversary.scope_shape("bsc", (8, 16)) == (8, 16)


# ---------------------------------------------------------------- the step: [S13, S14, S24]


def _tiny_cfg(**loss_kw):
    """TMS 5-2, batch 32, C = 4 per site, 10 steps; `loss_kw` replace whole loss fields."""
    cfg = config({"data.batch_size": 32, "decomp.steps": 10, "decomp.sites.*": 4})
    return dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, **loss_kw))


def _toy_target():
    from ppgd_tpu.config import TMSConfig

    return tms.init(TMSConfig(), jax.random.key(0))


@pytest.mark.parametrize("n_warmup", [0, 2])
def test_S13_S14_S24_adversary_updates_per_step_and_final_ascent(n_warmup):
    from ppgd_tpu.step import Decomposer

    term = PersistentPGDTerm(coeff=2.5, scope="bsc", n_warmup=n_warmup,
                             lr=Schedule("constant", 0.05))
    cfg = _tiny_cfg(persistent_pgd={"ppgd": term})
    t = _toy_target()
    dec = Decomposer(cfg, t, (32, 5))
    state = dec.init(t)
    x = t.sample(jax.random.key(5), 32)
    new, metrics = dec.full(state, t, x)
    adv = new.adversaries["ppgd"]
    assert float(adv.step_count) == n_warmup + 1
    src = np.asarray(adv.sources["linear1"])
    assert src.shape == (32, 5) and src.min() >= 0 and src.max() <= 1

    # Recompute by hand: n_warmup ascents on the detached objective, then the final one
    # from d(term)/d(sources) at pre-update components and live CI.
    ci = dec.ci(state.ci_fn, state.components, t, x)
    clean = t.clean_output(x)

    def term_value(sources):
        return dec.recon(t, x, state.components, dec.ppgd_masks(ci.lower, sources), clean)

    expected = state.adversaries["ppgd"]
    for _ in range(n_warmup):
        expected = adversary.ascend(expected, jax.grad(term_value)(expected.sources), term, 0.05)
    expected = adversary.ascend(expected, jax.grad(term_value)(expected.sources), term, 0.05)
    for s in dec.sites:
        np.testing.assert_allclose(adv.sources[s], expected.sources[s], rtol=1e-4, atol=1e-6)
    assert float(metrics["train/loss/ppgd"]) > 0


def test_S12_persistent_term_routes_every_site_with_masks_from_its_sources():
    """The term's forward: every site live and routed everywhere, mask = lower + (1 - lower)
    src[..., :C], delta mask = src[..., C]; each site's sources get a gradient (leaves)."""
    from ppgd_tpu.step import Decomposer

    term = PersistentPGDTerm(scope="bsc", n_warmup=0)
    cfg = _tiny_cfg(persistent_pgd={"ppgd": term})
    t = _toy_target()
    dec = Decomposer(cfg, t, (32, 5))
    state = dec.init(t)
    x = t.sample(jax.random.key(5), 32)
    lower = dec.ci(state.ci_fn, state.components, t, x).lower
    src = state.adversaries["ppgd"].sources
    masks = dec.ppgd_masks(lower, src)
    assert set(masks) == set(t.site_names)
    by_hand = {s: SiteMask(lower[s] + (1 - lower[s]) * src[s][:, :-1], src[s][:, -1])
               for s in t.site_names}
    for s in t.site_names:
        m = masks[s]()
        assert m.route is None
        np.testing.assert_allclose(m.mask, by_hand[s].mask, rtol=1e-6)
        np.testing.assert_allclose(m.delta, by_hand[s].delta)
    clean = t.clean_output(x)
    value = dec.recon(t, x, state.components, masks, clean)
    np.testing.assert_allclose(
        value, t.divergence(t.masked_forward(x, state.components, by_hand), clean), rtol=1e-6)
    g = jax.grad(lambda sr: dec.recon(t, x, state.components, dec.ppgd_masks(lower, sr),
                                      clean))(src)
    assert all(float(jnp.abs(g[s]).sum()) > 0 for s in t.site_names)


def test_S23_each_persistent_term_has_its_own_sources_and_ascends_on_its_own_gradient():
    """Two terms: two bundles, initialised apart; after a step each is what its term alone
    (its coeff, n_warmup and lr) makes of it."""
    from ppgd_tpu.step import Decomposer

    terms = {"a": PersistentPGDTerm(coeff=1.0, scope="bsc", n_warmup=1,
                                    lr=Schedule("constant", 0.05)),
             "b": PersistentPGDTerm(coeff=3.0, scope="sc", n_warmup=0,
                                    lr=Schedule("constant", 0.2))}
    cfg = _tiny_cfg(persistent_pgd=terms)
    t = _toy_target()
    dec = Decomposer(cfg, t, (32, 5))
    state = dec.init(t)
    a0, b0 = state.adversaries["a"], state.adversaries["b"]
    assert a0.sources["linear1"].shape == (32, 5) and b0.sources["linear1"].shape == (1, 5)
    assert not np.allclose(a0.sources["linear1"][:1], b0.sources["linear1"])
    x = t.sample(jax.random.key(5), 32)
    new, metrics = dec.full(state, t, x)
    ci = dec.ci(state.ci_fn, state.components, t, x)
    clean = t.clean_output(x)

    def alone(name):
        term, adv = terms[name], state.adversaries[name]
        value = lambda sr: dec.recon(t, x, state.components, dec.ppgd_masks(ci.lower, sr),
                                     clean)
        for _ in range(term.n_warmup + 1):  # the final ascent: d(coeff * term) / coeff
            adv = adversary.ascend(adv, jax.grad(value)(adv.sources), term, term.lr.value)
        return adv

    for name in terms:
        want = alone(name)
        assert float(new.adversaries[name].step_count) == terms[name].n_warmup + 1
        for s in dec.sites:
            np.testing.assert_allclose(new.adversaries[name].sources[s], want.sources[s],
                                       rtol=1e-4, atol=1e-6)
    assert float(metrics["train/loss/a"]) > 0 and float(metrics["train/loss/b"]) > 0


def test_R1_step_draws_depend_only_on_seed_and_step():
    from ppgd_tpu.step import Decomposer

    cfg = _tiny_cfg()
    t = _toy_target()
    dec = Decomposer(cfg, t, (32, 5))
    x = t.sample(jax.random.key(5), 32)
    s0 = dec.init(t)
    a, ma = dec.full(s0, t, x)
    b, mb = dec.full(dec.init(t), t, x)
    assert float(ma["train/loss/stochastic"]) == float(mb["train/loss/stochastic"])
    import equinox as eqx

    later = eqx.tree_at(lambda s: s.step, s0, jnp.int32(5))
    _, mc = dec.full(later, t, x)
    assert float(mc["train/loss/stochastic"]) != float(ma["train/loss/stochastic"])


def test_S21_faithfulness_warmup_reduces_faithfulness_only():
    from ppgd_tpu.step import Decomposer

    cfg = _tiny_cfg()
    cfg = config({"decomp.faithfulness_warmup_steps": 50, "decomp.faithfulness_warmup_lr": 1e-2},
                 base=cfg)
    t = _toy_target()
    dec = Decomposer(cfg, t, (32, 5))
    s0 = dec.init(t)
    s1 = dec.faithfulness_warmup(s0, t)
    w = t.site_weights()
    assert float(components.faithfulness(s1.components, w)) < 0.5 * float(
        components.faithfulness(s0.components, w))
    # the CI fn and the main optimizer state are untouched; the warmup optimizer is discarded
    for a, b in zip(jax.tree.leaves((s0.ci_fn, s0.opt_components)),
                    jax.tree.leaves((s1.ci_fn, s1.opt_components))):
        np.testing.assert_array_equal(a, b)


def test_tie_grads_is_the_chain_rule_through_tie():
    """decomp.tie: the gradient a tied group gets is that of the loss as a function of the
    source's V, U alone (V_t = U_src^T, U_t = V_src^T); the tied sites' own is zero."""
    shapes = {"a": (5, 3), "b": (3, 5), "c": (3, 5), "d": (5, 3)}
    C = {s: 4 for s in shapes}
    ties = components.resolve_ties({"b": "a", "c": "a"}, C, shapes)
    base = components.init(jax.random.key(0), {s: jnp.zeros(sh) for s, sh in shapes.items()}, C)

    def loss(comps):  # a different nonlinear function of every site's V and U
        return sum(jnp.sum(jnp.sin((i + 1.0) * comps.V[s] @ comps.U[s])) + jnp.sum(
            comps.V[s] ** 3) * (i + 2.0) for i, s in enumerate(shapes))

    got = components.tie_grads(jax.grad(loss)(components.tie(base, ties)), ties)
    want = jax.grad(lambda c: loss(components.tie(c, ties)))(base)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(got.V["b"]).max()) == 0.0 and float(jnp.abs(got.U["a"]).max()) > 0


def test_tied_sites_stay_the_transposed_source_through_warmup_and_steps():
    from ppgd_tpu.step import Decomposer

    cfg = _tiny_cfg()
    cfg = config({"decomp.tie.linear2": "linear1", "decomp.faithfulness_warmup_steps": 5},
                 base=cfg)
    t = _toy_target()
    dec = Decomposer(cfg, t, (32, 5))
    x = t.sample(jax.random.key(5), 32)
    s = dec.init(t)
    untied = Decomposer(_tiny_cfg(), t, (32, 5)).init(t)
    assert not np.allclose(untied.components.V["linear2"], untied.components.U["linear1"].T)
    states = [s, dec.faithfulness_warmup(s, t)]
    for _ in range(2):
        states.append(dec.full(states[-1], t, x)[0])
    for st in states:
        c = st.components
        np.testing.assert_array_equal(c.V["linear2"], c.U["linear1"].T)
        np.testing.assert_array_equal(c.U["linear2"], c.V["linear1"].T)
    assert not np.array_equal(states[-1].components.V["linear1"], states[1].components.V["linear1"])


@pytest.mark.parametrize("ties,needle", [
    ({"linear2": "linear3"}, "decomp.tie.linear2: 'linear3' is not a decomposed site"),
    ({"linear2": "linear1", "linear1": "linear2"}, "decomp.tie.linear2: 'linear1' is itself tied"),
    ({"linear2": "linear2"}, "decomp.tie.linear2: 'linear2' is itself tied"),
    ({"hidden_layers.0": "linear1"}, "decomp.tie.hidden_layers.0: hidden_layers.0 (weight (2, 2)"),
])
def test_bad_ties_are_refused_naming_the_field(ties, needle):
    from ppgd_tpu.config import ConfigError

    shapes = {"linear1": (5, 2), "hidden_layers.0": (2, 2), "linear2": (2, 5)}
    with pytest.raises(ConfigError, match=re.escape(needle)):
        components.resolve_ties(ties, {s: 4 for s in shapes}, shapes)
    with pytest.raises(ConfigError, match="needs the transposed weight shape and the same C"):
        components.resolve_ties({"linear2": "linear1"}, {"linear1": 4, "linear2": 3,
                                                         "hidden_layers.0": 2}, shapes)


@pytest.mark.parametrize("scope", ["sc", "bsc"])
def test_fresh_pgd_term_trains_components_not_sources_and_is_adversarial(scope):
    """The fresh sign-PGD term, recomputed by hand: sources ~ U[0,1] per site (key
    fold_in(fold_in(fold_in(seed, step), FRESH + i), site i)), then n_steps of
    clamp(src + step_size * sign(d recon / d src)) against the frozen components and lower CI;
    the term is the recon at those fixed sources. The logged loss is that value, well above
    the value at the unascended sources; the components and the envelope get exactly coeff
    times its gradient at the fixed sources (a coeff-0 run differs by that), and so does the
    step's component gradient (its logged norm); nothing persists between steps."""
    from ppgd_tpu.config import FreshPGDTerm
    from ppgd_tpu.step import _FRESH, CIRows, Decomposer, Envelope

    n_steps, step_size, coeff = 5, 0.2, 1.5
    t = _toy_target()

    def make(c):
        term = FreshPGDTerm(coeff=c, n_steps=n_steps, step_size=step_size, scope=scope)
        return Decomposer(_tiny_cfg(fresh_pgd={"fresh": term}), t, (32, 5))

    dec, dec0 = make(coeff), make(0.0)
    assert dec.cfg.decomp.use_delta
    state = dec.init(t)
    x = t.sample(jax.random.key(5), 32)
    new, m = dec.full(state, t, x)
    _, m0 = dec0.full(state, t, x)
    assert state.adversaries == {} and new.adversaries == {}  # nothing persists

    comps = state.components
    lower = dec.ci(state.ci_fn, comps, t, x).lower
    clean = t.clean_output(x)

    def recon(c, low, src):  # [S12] by hand: every site live, masks from the sources
        masks = {s: SiteMask(low[s] + (1 - low[s]) * src[s][..., :-1], src[s][..., -1])
                 for s in dec.sites}
        return t.divergence(t.masked_forward(x, c, masks), clean)

    step_key = jax.random.fold_in(jax.random.key(dec.cfg.seed), 0)
    k = jax.random.fold_in(step_key, _FRESH + 0)  # the first (only) fresh term
    shape = (1, 5) if scope == "sc" else (32, 5)  # linear1 / linear2: C = 4, + delta channel
    src0 = {s: jax.random.uniform(jax.random.fold_in(k, i), shape)
            for i, s in enumerate(dec.sites)}
    src = src0
    for _ in range(n_steps):  # sign ascent on the recon, comps and lower held fixed
        g = jax.grad(lambda sr: recon(comps, lower, sr))(src)
        src = {s: jnp.clip(src[s] + step_size * jnp.sign(g[s]), 0.0, 1.0) for s in src}
    value, start = float(recon(comps, lower, src)), float(recon(comps, lower, src0))
    assert value > 10.0 * start  # the ascent finds much worse masks than U[0,1] ones
    assert float(m["train/loss/fresh"]) == pytest.approx(value, rel=1e-5)
    assert float(m0["train/loss/fresh"]) == pytest.approx(value, rel=1e-5)  # coeff 0 too

    # The loss's gradient: a coeff-0 term adds nothing, a coeff-c one adds c times the recon's
    # gradient at the fixed sources (none through the ascent), w.r.t. components and lower CI.
    env = dec.compute_ci(t, state, x)
    every = Subset.all(32)

    def loss_grad(d):
        return jax.grad(lambda c, e: d._losses(d._inputs(jnp.int32(0), t, x), every,
                                               CIRows(every.take, None), c, {}, e)[0],
                        argnums=(0, 1))(comps, env)

    (gc, ge), (gc0, ge0) = loss_grad(dec), loss_grad(dec0)
    fc, fl = jax.grad(recon, argnums=(0, 1))(comps, env.lower, src)
    for a, b, f in zip(jax.tree.leaves(gc), jax.tree.leaves(gc0), jax.tree.leaves(fc)):
        assert float(jnp.abs(f).max()) > 0
        np.testing.assert_allclose(a - b, coeff * f, rtol=1e-4, atol=1e-4 * float(
            jnp.abs(coeff * f).max()))
    for s in dec.sites:
        np.testing.assert_allclose(ge.lower[s] - ge0.lower[s], coeff * fl[s], rtol=1e-4,
                                   atol=1e-4 * float(jnp.abs(coeff * fl[s]).max()))
        np.testing.assert_array_equal(ge.upper[s], ge0.upper[s])

    # The step (live rows, CI fn live: its path into V too): the component gradient whose
    # norm it logs is the coeff-0 one plus coeff times the term's, both through the CI fn.
    taps = t.read_activations(x, state.ci_fn.input_names)

    def through_ci(f):
        def of(c):
            ci = ci_fn.ci_from_logits(state.ci_fn(taps, c))
            return f(c, Envelope(ci.lower, ci.upper))
        return jax.grad(of)(comps)

    g0 = through_ci(lambda c, e: dec0._losses(dec0._inputs(jnp.int32(0), t, x), every,
                                              CIRows(every.take, None), c, {}, e)[0])
    gf = through_ci(lambda c, e: recon(c, e.lower, src))
    norm = lambda tree: float(jnp.sqrt(sum(jnp.sum(jnp.square(a))
                                           for a in jax.tree.leaves(tree))))
    want = norm(jax.tree.map(lambda a, b: a + coeff * b, g0, gf))
    key = "train/grad_norms/summary/components"
    assert float(m0[key]) == pytest.approx(norm(g0), rel=1e-4)
    assert float(m[key]) == pytest.approx(want, rel=1e-4)
    assert abs(want - norm(g0)) > 0.05 * norm(g0)  # the term's share is visible in the norm
    assert np.isfinite(float(m["train/loss/total"]))


def test_N1_bf16_compute_keeps_fp32_masters_and_fp32_losses():
    from ppgd_tpu.step import Decomposer

    cfg = _tiny_cfg()
    cfg = config({"decomp.compute_dtype": "bfloat16"}, base=cfg)
    t = _toy_target()
    dec = Decomposer(cfg, t, (32, 5))
    state = dec.init(t)
    x = t.sample(jax.random.key(5), 32)
    new, m = dec.full(state, t, x)
    for leaf in jax.tree.leaves((new.components, new.ci_fn, new.opt_components)):
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert leaf.dtype == jnp.float32
    assert m["train/loss/total"].dtype == jnp.float32
    # [S17] faithfulness is against the fp32 W from the fp32 V/U, not bf16(W)
    faith = sum(np.sum((np.float64(W) - np.float64(state.components.V[s])
                        @ np.float64(state.components.U[s])) ** 2)
                for s, W in t.site_weights().items())
    faith /= sum(W.size for W in t.site_weights().values())
    assert float(m["train/loss/faithfulness"]) == pytest.approx(faith, rel=1e-5)
    env = dec.compute_ci(t, state, x)
    assert env.lower["linear1"].dtype == jnp.bfloat16  # the envelope is in compute dtype
    f32 = Decomposer(_tiny_cfg(), t, (32, 5))
    _, m32 = f32.full(state, t, x)
    # same math up to bf16 rounding: 8 significand bits, a relative error of at most
    # 2^-8 ~ 4e-3 per rounding; the forward's few roundings (inputs, masks, weights, each
    # product) stay within 2e-2, ~5 roundings' worth (measured: 2.6e-3)
    assert float(m["train/loss/stochastic"]) == pytest.approx(
        float(m32["train/loss/stochastic"]), rel=2e-2)


def test_N2_a_bf16_forward_stays_bf16_under_fp32_masks():
    """Sources and mask draws are fp32 [N1]; multiplied into a bf16 forward they promoted
    every site output after the first decomposed one to fp32, so the masked path ran in fp32
    against a bf16 clean output. All-ones masks with the delta are the identity [S2]: the
    masked output must then be the bf16 clean output, bit for bit, and no matmul of the
    step may mix fp32 and bf16 operands."""
    from ppgd_tpu.step import Decomposer, _cast

    cfg = _tiny_cfg()
    cfg = config({"decomp.compute_dtype": "bfloat16"}, base=cfg)
    from ppgd_tpu.config import TMSConfig

    t = tms.init(TMSConfig(n_features=6, n_hidden=3, n_identity_layers=1), jax.random.key(0))
    dec = Decomposer(cfg, t, (16, 6))
    jaxpr = jax.make_jaxpr(dec.full)(dec.init(t), t, t.sample(jax.random.key(5), 16))
    mixed = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"
             and len({v.aval.dtype for v in e.invars}) > 1]
    assert not mixed, mixed[:3]
    state = dec.init(t)
    x = t.sample(jax.random.key(5), 16)
    t16, x16 = _cast(t, jnp.bfloat16), x.astype(jnp.bfloat16)
    comps16 = _cast(state.components, jnp.bfloat16)
    ones = {s: SiteMask(jnp.ones((16, V.shape[1]), jnp.float32),
                        jnp.ones((16,), jnp.float32)) for s, V in comps16.V.items()}
    masked = t16.masked_forward(x16, comps16, ones)
    clean = t16.clean_output(x16)
    assert masked.dtype == clean.dtype == jnp.bfloat16
    assert np.abs(np.asarray(clean, np.float32)).max() > 0.1
    np.testing.assert_array_equal(np.asarray(masked, np.float32), np.asarray(clean, np.float32))


def _eqns(jaxpr):
    """Every equation of a jaxpr, those of its sub-jaxprs (jit, scan, cond, vjp) included."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


@pytest.mark.parametrize("lead,zero_rows", [((4096,), 0.0), ((4096,), 0.77), ((6, 7), 0.5),
                                             ((97,), 0.0), ((1000,), 1.0)])
def test_S5_per_component_ci_mlp_and_its_chunked_backward_match_the_formula(lead, zero_rows):
    """out_c = sum_h w2 gelu_tanh(a_c w1 + b1) + b2 and its vjp, against autodiff of that
    formula in float64. (4096,) walks the rows in several chunks on CPU; a fraction
    `zero_rows` of all-zero input rows (TMS: 77%) skips them, their output f(0) and input
    gradient g f'(0) included; (1000,) has no live row at all."""
    with jax.enable_x64(True):
        C, h = 20, 16
        ks = jax.random.split(jax.random.key(0), 7)
        a = jax.random.normal(ks[0], lead + (C,), jnp.float64)
        a = jnp.where(jax.random.bernoulli(ks[6], zero_rows, lead)[..., None], 0.0, a)
        args = [a, *(jax.random.normal(k, (C, h), jnp.float64) for k in ks[1:4]),
                jax.random.normal(ks[4], (C,), jnp.float64)]
        g = jax.random.normal(ks[5], lead + (C,), jnp.float64)

        def formula(a, w1, b1, w2, b2):
            pre = a[..., None] * w1 + b1
            gelu = 0.5 * pre * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (pre + 0.044715 * pre ** 3)))
            return jnp.einsum("...ch,ch->...c", gelu, w2) + b2

        out, vjp = jax.jit(lambda *x: jax.vjp(component_mlp.component_mlp, *x))(*args)
        want, want_vjp = jax.vjp(formula, *args)
        np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
        for got, exp in zip(vjp(g), want_vjp(g)):
            assert got.shape == exp.shape
            np.testing.assert_allclose(got, exp, rtol=1e-10, atol=1e-10 * float(jnp.abs(exp).max()))
    if lead == (4096,):
        assert component_mlp.chunk_rows(4096, C * h) < 4096 / 2


def test_S5_sites_sharing_one_ci_mlp_call_get_their_own_outputs_and_gradients():
    """site_mlps runs narrow sites through one kernel call concatenated on C (two TMS-sized
    sites), wide ones alone (the third): each site's output and every gradient equal its
    own call's; rows live at one site only are in the shared call's live rows."""
    widths = {"a": 20, "b": 20, "c": 100}
    h, rows = 16, 512
    ks = iter(jax.random.split(jax.random.key(0), 32))
    acts = {s: jax.random.normal(next(ks), (rows, C)) for s, C in widths.items()}
    acts["a"] = acts["a"].at[: rows // 2].set(0.0)  # live at "b" only
    acts["b"] = acts["b"].at[rows // 4:].set(0.0)  # live at "a" only, then dead at both
    w = [{s: jax.random.normal(next(ks), (C, h)) for s, C in widths.items()} for _ in range(3)]
    b2 = {s: jax.random.normal(next(ks), (C,)) for s, C in widths.items()}
    g = {s: jax.random.normal(next(ks), (rows, C)) for s, C in widths.items()}
    assert widths["a"] * h + widths["b"] * h <= component_mlp.MERGE_WIDTH
    assert widths["b"] * h + widths["c"] * h > component_mlp.MERGE_WIDTH

    def own(acts, w1, b1, w2, b2):
        return {s: component_mlp.component_mlp(acts[s], w1[s], b1[s], w2[s], b2[s])
                for s in acts}

    args = (acts, *w, b2)
    got, got_vjp = jax.jit(lambda *x: jax.vjp(component_mlp.site_mlps, *x))(*args)
    want, want_vjp = jax.jit(lambda *x: jax.vjp(own, *x))(*args)
    for s in widths:
        np.testing.assert_allclose(got[s], want[s], rtol=1e-6, atol=1e-6)
    for x, y in zip(jax.tree.leaves(got_vjp(g)), jax.tree.leaves(want_vjp(g))):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows,k", [(4096, 408), (2048, 80), (97, 8), (5000, 512), (1, 8)])
def test_S5_ci_mlp_live_row_chunks_are_the_nonzero_rows_in_order(rows, k):
    """The chunk index table of the zero-row skip: the rows with any nonzero input, in row
    order, padded with `rows`, and the count of chunks holding them, for live fractions from
    none to all (its prefix count is two triangular matmuls, not a cumsum)."""
    for p_live in (0.0, 0.05, 0.23, 0.63, 1.0):
        live = np.random.default_rng(rows).random(rows) < p_live
        a = jnp.asarray(np.where(live[:, None], 1.0, 0.0) * np.ones((rows, 3)), jnp.float32)
        idx, n_live, got_live = jax.jit(component_mlp._live_chunks, static_argnums=1)(a, k)
        n = -(-rows // k)
        want = np.full(n * k, rows)
        want[:live.sum()] = np.flatnonzero(live)
        np.testing.assert_array_equal(np.asarray(idx).reshape(-1), want)
        assert int(n_live) == -(-int(live.sum()) // k)
        np.testing.assert_array_equal(got_live, live)


@pytest.mark.parametrize("n_layers", [1, 2])
def test_S2_resid_mlp_factored_residual_equals_the_dense_forward(n_layers):
    """ResidMLP keeps its residual stream factored (targets/lowrank.py); clean, masked (mask,
    delta, route) and their component gradients equal the dense forward's, in float64."""
    from ppgd_tpu.config import ResidMLPConfig
    from ppgd_tpu.targets.base import site_out

    with jax.enable_x64(True):
        f64 = lambda tree: jax.tree.map(lambda a: a.astype(jnp.float64), tree)
        t = f64(resid_mlp.init(ResidMLPConfig(n_layers=n_layers, d_embed=200, d_mlp=20),
                               jax.random.key(0)))
        B, C = 32, 12
        x = t.sample(jax.random.key(1), B).astype(jnp.float64)
        comps = f64(components.init(jax.random.key(2), t.site_weights(),
                                    {s: C for s in t.site_names}))
        k = jax.random.split(jax.random.key(3), 3)
        masks = {s: SiteMask(jax.random.uniform(k[0], (B, C), jnp.float64),
                             jax.random.uniform(k[1], (B,), jnp.float64),
                             jax.random.bernoulli(k[2], 0.5, (B,)))
                 for s in t.site_names}

        def dense_forward(site_fn):
            r = x @ t.W_E
            for i, (w_in, w_out) in enumerate(zip(t.W_in, t.W_out)):
                h = jax.nn.relu(site_fn(f"layers.{i}.mlp_in", r, w_in))
                r = r + site_fn(f"layers.{i}.mlp_out", h, w_out)
            return r @ t.W_E.T

        np.testing.assert_allclose(t.clean_output(x), dense_forward(lambda n, h, W: h @ W),
                                   rtol=1e-12, atol=1e-14)
        got = lambda c: jnp.sum(jnp.sin(t.masked_forward(x, c, masks)))
        want = lambda c: jnp.sum(jnp.sin(dense_forward(
            lambda n, h, W: site_out(h, W, c.V[n], c.U[n], masks[n]))))
        np.testing.assert_allclose(got(comps), want(comps), rtol=1e-12)
        for a, b in zip(jax.tree.leaves(jax.grad(got)(comps)),
                        jax.tree.leaves(jax.grad(want)(comps))):
            np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12 * float(jnp.abs(b).max()))


_SHARDED_CI_MLP = """
import ppgd_tpu; ppgd_tpu.configure_cpu()
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from ppgd_tpu.decomp.component_mlp import component_mlp, chunk_rows
ks = jax.random.split(jax.random.key(0), 6); C, h, B = 20, 16, 4096
a = jax.random.normal(ks[0], (B, C)) * (jnp.arange(B) % 4 == 0)[:, None]  # 3/4 zero rows
args = [a] + [jax.random.normal(k, (C, h)) for k in ks[1:4]] + [jax.random.normal(ks[4], (C,))]
g = jax.random.normal(ks[5], (B, C))
want = jax.jit(lambda *a: jax.vjp(component_mlp, *a)[1](g))(*args)
assert jax.device_count() == 4, jax.devices()  # the forced host devices took effect
mesh = jax.sharding.Mesh(jax.devices(), ("data",))  # Auto axes, as ppgd_tpu.mesh builds
rows, rep = NamedSharding(mesh, P("data")), NamedSharding(mesh, P())
placed = [jax.device_put(args[0], rows)] + [jax.device_put(a, rep) for a in args[1:]]
assert len(placed[0].addressable_shards) == 4  # the rows really are split over them
assert {s.data.shape for s in placed[0].addressable_shards} == {(B // 4, C)}
got = jax.jit(lambda *a: jax.vjp(component_mlp, *a)[1](jax.device_put(g, rows)))(*placed)
assert chunk_rows(B, C * h) < B
print("REL", max(float(jnp.max(jnp.abs(x - y)) / jnp.max(jnp.abs(y))) for x, y in zip(got, want)))
"""


def test_D3_per_component_ci_mlp_backward_on_row_sharded_rows_matches_one_device():
    """The chunked, zero-row-skipping backward on a batch split over 4 devices (Auto axes, as
    ppgd_tpu.mesh builds them; XLA gathers the live rows across shards): every cotangent
    equals the one-device one up to reassociation."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    p = subprocess.run([sys.executable, "-c", _SHARDED_CI_MLP], env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    assert float(p.stdout.split("REL")[1]) < 1e-5


@pytest.mark.parametrize("shape", [(4096, 21), (3, 5, 7), (2, 3, 4, 5), (1,), (0, 4)])
def test_R1_rng_draws_are_bit_identical_to_jax_random(shape):
    """rng.uniform (unrolled threefry: the stochastic masks) and rng.normal (drawn flat: the
    inits) are jax.random.uniform / normal bit for bit, under jit and eagerly, so using them
    changed no trajectory; other PRNG implementations fall back to JAX's own draws."""
    once = functools.partial(rng.uniform, once=True)
    for ours, theirs in ((rng.uniform, jax.random.uniform), (once, jax.random.uniform),
                         (rng.normal, jax.random.normal)):
        for seed in range(3):
            key = jax.random.fold_in(jax.random.key(seed), 1000 + seed)
            want = theirs(key, shape)
            np.testing.assert_array_equal(jax.jit(ours, static_argnums=1)(key, shape), want)
            np.testing.assert_array_equal(ours(key, shape), want)
        rbg = jax.random.key(0, impl="rbg")
        np.testing.assert_array_equal(ours(rbg, shape), theirs(rbg, shape))


def test_R1_mask_draw_is_hashed_once_however_many_fusions_read_it():
    """A stochastic mask's draw is read by the forward, the backward and the delta channel;
    XLA:CPU used to copy the 20-round hash into each of those fusions (and up to twice per
    element). The compiled masked product's gradient holds as many hash rounds as the bare
    draw does."""
    shape = (256, 21)

    def rounds(f, *args):  # each of threefry's 20 rotations is one shift-left
        return jax.jit(f).lower(*args).compile().as_text().count("shift-left(")

    def masked(key, lower, a, w):  # the stochastic recon's own mask draw
        site = losses._stochastic_site_mask(key, lower, True, None, shape[:1], None)
        return jnp.sum(jnp.tanh((a * site.mask) @ w) * site.delta[:, None])

    key, lower, a, w = jax.random.key(1), jnp.full((256, 20), 0.3), jnp.ones((256, 20)), \
        jnp.ones((20, 4))
    bare = rounds(lambda k: rng.uniform(k, shape, once=True), key)
    assert bare >= 20
    assert rounds(jax.grad(masked, argnums=(1, 2)), key, lower, a, w) == bare


def test_R1_toy_data_is_bit_identical_to_jax_random():
    """The toy batches drawn with rng.uniform are JAX's split / bernoulli / uniform draws bit
    for bit (TMS's [0, 1) and ResidMLP's [-1, 1) values), so the switch changed no batch."""
    from ppgd_tpu.data.toy import sparse_features

    def jax_features(key, batch, n, p, lo, hi):
        k_on, k_val = jax.random.split(key)
        on = jax.random.bernoulli(k_on, p, (batch, n))
        return jnp.where(on, jax.random.uniform(k_val, (batch, n), minval=lo, maxval=hi), 0.0)

    for seed in range(3):
        for args in ((4096, 5, 0.05, 0.0, 1.0), (2048, 100, 0.01, -1.0, 1.0),
                     (64, 7, 0.5, 0.3, 1.7)):
            key = jax.random.key(seed)
            ours = jax.jit(sparse_features, static_argnums=(1, 2, 3, 4, 5))(key, *args)
            assert 0 < int(jnp.sum(ours != 0)) < ours.size
            np.testing.assert_array_equal(
                ours, jax.jit(jax_features, static_argnums=(1, 2, 3, 4, 5))(key, *args))


# ---------------------------------------------------------------- recon on the live rows only


def _live_sizes_by_formula(rows, feature_probability, n_features):
    """live_rows.sizes's documented rule, from its formula: a row is live unless all its
    n_features features are off, p = 1 - (1 - feature_probability)^n_features; the live
    count is Binomial(rows, p), bounded by its mean + 6 sd rounded up to a multiple of 8,
    an extra size only when that is at most half the batch."""
    p = 1.0 - (1.0 - feature_probability) ** n_features
    bound = rows * p + 6.0 * np.sqrt(rows * p * (1.0 - p))
    k = 8 * int(np.ceil(bound / 8.0))
    return (k, rows) if k <= rows // 2 else (rows,)


@pytest.mark.parametrize("kind,data_p,size,ci_kind", [
    ("tms", 0.05, 0, "per_component_mlp"), ("tms", 0.6, 1, "per_component_mlp"),
    ("tms", 0.05, 0, "global_mlp"), ("resid_mlp", 0.01, 0, "per_component_mlp"),
    ("resid_mlp", 0.6, 1, "per_component_mlp")])
def test_step_on_the_live_rows_equals_the_full_batch_step(kind, data_p, size, ci_kind):
    """live_rows.py: a row whose every site input is zero cannot move a recon divergence or
    any gradient, so the step that runs its masked forwards (stochastic with uniform_k
    routes, layerwise, persistent `bsc` with warmups and `sc`, fresh PGD) on the live rows
    only is the full-batch step. Its CI fn runs on those rows plus one zero row counted for
    too. TMS declares feature_probability 0.05 (rows: 256, gathered: 104), the ResidMLP
    0.01 over 20 features (gathered: 88; its site inputs factored, targets/lowrank.py); data
    drawn at 0.6 has more live rows and takes the full-batch branch."""
    from ppgd_tpu.config import FreshPGDTerm, ResidMLPConfig, TMSConfig
    from ppgd_tpu.step import Decomposer

    cfg = _tiny_cfg(
        stochastic={"stochastic": StochasticTerm(routing="uniform_k"),
                    "layerwise": StochasticTerm(plan="chunked")},
        persistent_pgd={"bsc": PersistentPGDTerm(scope="bsc", n_warmup=2),
                        "sc": PersistentPGDTerm(scope="sc", lr=Schedule("constant", 0.1))},
        fresh_pgd={"fresh": FreshPGDTerm(n_steps=3, scope="bsc")},
        imp_min=ImpMinConfig(coeff=3e-3, p=Schedule("constant", 1.0), freq_coeff=1e-3,
                             reference_token_count=256.0))
    cfg = config({"decomp.ci_fn.kind": ci_kind}, base=cfg)
    if kind == "tms":
        t, fp = tms.init(TMSConfig(feature_probability=0.05), jax.random.key(0)), 0.05
    else:
        t, fp = resid_mlp.init(ResidMLPConfig(n_features=20, d_embed=40, d_mlp=8,
                                              feature_probability=0.01), jax.random.key(0)), 0.01
    rows = 256
    want = _live_sizes_by_formula(rows, fp, t.n_features)
    data = dataclasses.replace(t, feature_probability=data_p)
    live = Decomposer(cfg, t, (rows, t.n_features))
    full = Decomposer(cfg, t, (rows, t.n_features))
    full.skip_dead_rows = False
    assert live.live_sizes == want and live.skip_dead_rows
    state = live.init(t)
    # the second step starts from trained adversaries and components, on another batch: rows
    # live in the first and dead in the second carry Adam moments into their idle ascents
    for seed in (5, 6):
        x = data.sample(jax.random.key(seed), rows)
        assert full.live_rows(t, x) is None
        assert int(live.live_rows(t, x).size) == size  # the branch this batch takes
        a, ma = jax.jit(live.full)(state, t, x)
        b, mb = jax.jit(full.full)(state, t, x)
        for k in mb:
            np.testing.assert_allclose(ma[k], mb[k], rtol=2e-5, atol=1e-9, err_msg=k)
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            np.testing.assert_allclose(u, v, rtol=2e-5, atol=1e-7)
        state = b
    assert float(mb["train/loss/layerwise"]) > 0 and float(mb["train/loss/bsc"]) > 0


def test_live_row_sizes_bound_the_live_rows_of_a_toy_batch():
    from ppgd_tpu.decomp import live_rows

    for rows, fp, n in ((4096, 0.05, 5),  # TMS 5-2: 926 +- 27 live: an extra size
                        (256, 0.05, 5), (256, 0.01, 20), (1024, 0.01, 40), (64, 0.001, 5),
                        (2048, 0.01, 100)):  # ResidMLP: 1298 +- 22 live: none
        want = _live_sizes_by_formula(rows, fp, n)
        assert live_rows.sizes(rows, 1 - (1 - fp) ** n) == want, (rows, fp, n)
        if len(want) == 2:  # a bound on the live rows below the batch, never too small
            p = 1 - (1 - fp) ** n
            assert want[0] % 8 == 0 and rows * p + 6 * np.sqrt(rows * p * (1 - p)) <= want[0]
    assert len(_live_sizes_by_formula(4096, 0.05, 5)) == 2
    assert len(_live_sizes_by_formula(2048, 0.01, 100)) == 1
    assert live_rows.sizes(64, 0.99) == (64,)  # nothing to save: no extra branch
    assert live_rows.sizes(64, None) == (64,)  # unknown (LMs): no extra branch


@pytest.mark.parametrize("n_live", [0, 1, 16, 17, 48, 49, 64])
def test_live_rows_orders_live_rows_first_and_picks_the_smallest_size_holding_them(n_live):
    from ppgd_tpu.decomp import live_rows
    from ppgd_tpu.targets.lowrank import LowRank

    rows, sizes = 64, (16, 32, 48, 64)
    live = np.zeros(rows, bool)
    live[np.random.default_rng(n_live).permutation(rows)[:n_live]] = True
    half = rows // 2
    a = np.zeros((rows, 3), np.float32)
    a[:half][live[:half]] = 1.0  # the first half's live rows seen by a dense tap,
    coeffs = np.zeros((rows, 2), np.float32)
    coeffs[half:][live[half:], 1] = -2.0  # the second half's by a factored one
    taps = {"dense": jnp.asarray(a),
            "factored": LowRank((jnp.asarray(coeffs),), (jnp.ones((2, 7)),))}
    got = jax.jit(live_rows.find, static_argnums=1)(taps, sizes)
    order = np.concatenate([np.flatnonzero(live), np.flatnonzero(~live)])
    np.testing.assert_array_equal(got.order, order)
    np.testing.assert_array_equal(np.asarray(got.slot)[order], np.arange(rows))  # inverse
    assert int(got.size) == min(i for i, k in enumerate(sizes) if k >= n_live)


def test_subset_put_writes_the_subset_rows_back_and_leaves_the_others():
    from ppgd_tpu.decomp import live_rows

    live = jnp.asarray(np.random.default_rng(0).random(40) < 0.3)
    order, slot, _ = live_rows.live_first(live)
    sub = live_rows.Subset(order, slot, 16)
    full = {"rows": jnp.arange(40 * 3, dtype=jnp.float32).reshape(40, 3),
            "shared": jnp.zeros((1, 3)), "count": jnp.float32(1.0)}
    new = jax.tree.map(lambda a: -1.0 - a, sub.take(full))
    put = jax.jit(lambda f, t: sub.put(t, lambda: f))
    got = put(full, new)
    want = np.asarray(full["rows"]).copy()
    want[np.asarray(order)[:16]] = np.asarray(new["rows"])
    np.testing.assert_array_equal(got["rows"], want)
    assert (want < 0).sum() == 16 * 3
    np.testing.assert_array_equal(got["shared"], new["shared"])  # not per row: the new leaf
    assert float(got["count"]) == -2.0
    np.testing.assert_array_equal(put(full, sub.take(full))["rows"], full["rows"])
    every = live_rows.Subset.all(40)  # every row in place: each method the identity
    assert every.take(full) is full and every.put(new, lambda: full) is new
    assert every.take_and_zero_row(full) is full and every.head(full) is full
    assert every.share(full["count"]) is full["count"] and every.counts is None
    assert every.indices is None and every.full_shape((40,)) == (40,)


@pytest.mark.parametrize("shape", [(50, 21), (50, 4), (50,), (6, 7, 3)])
def test_R1_a_draw_on_some_rows_is_those_rows_of_the_full_draw(shape):
    key = jax.random.key(3)
    idx = jnp.asarray([0, 5, 2, shape[0] - 1, 5], jnp.int32)
    full = jax.jit(lambda k: rng.uniform(k, shape))(key)
    some = jax.jit(lambda k, i: rng.uniform(k, shape, rows=i))(key, idx)
    np.testing.assert_array_equal(some, np.asarray(full)[np.asarray(idx)])
