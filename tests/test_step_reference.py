"""SPEC 2-6 end to end: one full training step of TMS (with an identity layer) written out
again from the SPEC text in plain jax.numpy, against `Decomposer.full`.

The other step tests build their expected values from the package's own pieces (its loss
function, its masks, its ascent): they pin the wiring. This one shares nothing with the
package but the target's weights, the initial state and the RNG derivation [R1]: forward
with routes and the delta channel [S2], the squashings and their custom backward [S5, S6],
smooth-L0 imp-min with a scheduled gamma and the frequency term [S7, S8], a uniform_k and a
chunked stochastic term [S10, S11], a `bsc` and an `sc` persistent adversary with warmup
ascents and the final ascent from the fused backward divided by coeff [S12-S15, S23, S24],
faithfulness [S17], the clip [S19], the schedules [S20] and a tied site pair. The batch is
sparse, so the step takes its live-rows path (the same math, reassociated)."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppgd_tpu.config import Config, TMSConfig, from_dict
from ppgd_tpu.step import Decomposer
from ppgd_tpu.targets import tms

B, C, N, STEPS, S0 = 256, 4, 5, 10, 2
GAMMA, FRAC_GAMMA, LR_C, FRAC_C = 0.5, 0.2, 0.01, 0.1
COEFF = {"faithfulness": 0.3, "imp_min": 0.02, "freq": 0.01, "st": 1.1, "lw": 0.7, "pb": 2.0,
         "ps": 0.5}
ADV = {"pb": {"scope": "bsc", "n_warmup": 2, "lr": 0.05},
       "ps": {"scope": "sc", "n_warmup": 1, "lr": 0.1}}
REF_TOKENS, CLIP = 50.0, 0.01
# [R1] fold_in indices of the step key: stochastic term i, its plan entry e and draw d, the
# uniform_k routes of an entry; ppgd_tpu/step.py and decomp/losses.py fix them.
STOCHASTIC, ROUTES = 1000, 1 << 20


def _config():
    return from_dict(Config, {
        "decomp": {"sites": {"*": C}, "steps": STEPS, "weight_decay": 0.05,
                   "grad_clip_components": CLIP, "tie": {"linear2": "linear1"},
                   "lr_components": {"kind": "cosine", "value": LR_C, "final_frac": FRAC_C},
                   "lr_ci_fn": {"kind": "constant", "value": 0.02},
                   "ci_fn": {"kind": "per_component_mlp", "hidden": 3}},
        "loss": {"faithfulness_coeff": COEFF["faithfulness"],
                 "imp_min": {"coeff": COEFF["imp_min"], "kind": "smooth_l0",
                             "gamma": {"kind": "linear", "value": GAMMA,
                                       "final_frac": FRAC_GAMMA},
                             "freq_coeff": COEFF["freq"], "reference_token_count": REF_TOKENS},
                 "stochastic": {"st": {"coeff": COEFF["st"], "routing": "uniform_k"},
                                "lw": {"coeff": COEFF["lw"], "plan": "chunked", "chunk_size": 2,
                                       "n_draws": 2}},
                 "persistent_pgd": {n: {"coeff": COEFF[n], "scope": a["scope"],
                                        "n_warmup": a["n_warmup"], "lr": {"value": a["lr"]}}
                                    for n, a in ADV.items()}}})


@jax.custom_vjp
def _lower(x):  # [S6] lower_leaky_hard
    return jnp.clip(x, 0.0, 1.0)


def _lower_bwd(x, g):
    inside = (x > 0) & (x <= 1)
    return (jnp.where(inside, g, jnp.where((x <= 0) & (g < 0), 0.01 * g, 0.0)),)


_lower.defvjp(lambda x: (_lower(x), x), _lower_bwd)


def _upper(x):  # [S6] upper_leaky_hard
    return jnp.where(x > 1, 1 + 0.01 * (x - 1), jnp.clip(x, 0.0, 1.0))


def _gelu(z):
    return 0.5 * z * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))


def _mse(a, b):
    return jnp.mean((a - b) ** 2)


def _assert_close(what, got, want, rtol):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        err = np.max(np.abs(g - w)) / (1e-8 + rtol * np.max(np.abs(w)))
        assert err <= 1, f"{what}: off by {err:.3g} x the tolerance"


def test_S2_to_S24_one_full_step_against_an_independent_reference():
    t = tms.init(TMSConfig(n_identity_layers=1, feature_probability=0.05), jax.random.key(0))
    t = eqx.tree_at(lambda z: z.b, t, 0.1 * jax.random.normal(jax.random.key(9), (N,)))
    cfg = _config()
    dec = Decomposer(cfg, t, (B, N))
    state = dec.init(t)
    # one step first, on dense inputs, so the adversaries' moments are not zero
    dense = dataclasses.replace(t, feature_probability=0.5).sample(jax.random.key(4), B)
    state, _ = jax.jit(dec.full)(state, t, dense)
    state = eqx.tree_at(lambda s: s.step, state, jnp.int32(S0))
    x = t.sample(jax.random.key(5), B)  # sparse: ~23% live rows
    assert dec.skip_dead_rows and 0 < int(jnp.sum(jnp.any(x != 0, -1))) < B / 2
    new, metrics = jax.jit(dec.full)(state, t, x)

    W = t.site_weights()
    sites = list(W)

    def forward(site):  # TMS: linear1 -> identity layer -> linear2, + b, ReLU
        return jax.nn.relu(site("linear2", site("hidden_layers.0", site("linear1", x))) + t.b)

    clean = forward(lambda s, h: h @ W[s])
    taps = {}

    def record(s, h):
        taps[s] = h
        return h @ W[s]

    forward(record)

    def masked(V, U, masks):  # [S2] masks: {site: (mask, delta mask, route or None)}
        def site(s, h):
            if s not in masks:
                return h @ W[s]
            m, d, r = masks[s]
            y = ((h @ V[s]) * m) @ U[s] + (h @ (W[s] - V[s] @ U[s])) * d[..., None]
            return y if r is None else jnp.where(r[..., None], y, h @ W[s])
        return forward(site)

    def ci_logits(f, V):  # [S5] per-component scalar MLP on x V[:, c]
        return {s: jnp.einsum("bch,ch->bc", _gelu((taps[s] @ V[s])[..., None] * f.w1[s]
                                                  + f.b1[s]), f.w2[s]) + f.b2[s]
                for s in sites}

    def untie(P):  # the tie: linear2 = linear1^T, one parameter
        V, U = dict(P["V"]), dict(P["U"])
        V["linear2"], U["linear2"] = U["linear1"].T, V["linear1"].T
        return V, U

    progress = S0 / (STEPS - 1)  # [S20]
    gamma = GAMMA + (GAMMA * FRAC_GAMMA - GAMMA) * progress
    key = jax.random.fold_in(jax.random.key(cfg.seed), S0)

    def stochastic_masks(k, lower, live, uniform_k):  # [S10, S11]
        routes = None
        if uniform_k:
            kk, kp = jax.random.split(jax.random.fold_in(k, ROUTES))
            n_live = jax.random.randint(kk, (B,), 1, len(live) + 1)
            score = jax.random.uniform(kp, (len(live), B))
            routes = (score[None] < score[:, None]).sum(1) < n_live[None]  # the k lowest
        out = {}
        for i, s in enumerate(live):
            src = jax.random.uniform(jax.random.fold_in(k, i), (B, C + 1))
            out[s] = (lower[s] + (1 - lower[s]) * src[:, :C], src[:, C],
                      None if routes is None else routes[i])
        return out

    def source_masks(lower, src):  # [S12] all sites, routed everywhere
        return {s: (lower[s] + (1 - lower[s]) * src[s][..., :C], src[s][..., C], None)
                for s in sites}

    def loss(P, sources, f):
        V, U = untie(P)
        logits = ci_logits(f, V)
        lower = {s: _lower(v) for s, v in logits.items()}
        upper = {s: _upper(v) for s, v in logits.items()}
        parts = {"faithfulness": sum(jnp.sum((W[s] - V[s] @ U[s]) ** 2) for s in sites)
                 / sum(W[s].size for s in sites)}  # [S17]
        imp = freq = 0.0
        for s in sites:  # [S7, S8] smooth-L0, per component over the batch
            f_c = (upper[s] ** 2 / (upper[s] ** 2 + gamma ** 2)).mean(0)
            imp += f_c.sum()
            freq += (f_c * jnp.log2(1 + REF_TOKENS * f_c)).sum()
        parts["imp_min"] = COEFF["imp_min"] * imp + COEFF["freq"] * freq
        k_st = jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(key, STOCHASTIC), 0), 0)
        parts["st"] = _mse(masked(V, U, stochastic_masks(k_st, lower, sites, True)), clean)
        chunks = [sites[0:2], sites[2:3]]
        parts["lw"] = sum(_mse(masked(V, U, stochastic_masks(jax.random.fold_in(
            jax.random.fold_in(jax.random.fold_in(key, STOCHASTIC + 1), e), d), lower, live,
            False)), clean) for e, live in enumerate(chunks) for d in range(2)) / 4
        for n in ADV:
            parts[n] = _mse(masked(V, U, source_masks(lower, sources[n])), clean)
        parts["total"] = (COEFF["faithfulness"] * parts["faithfulness"] + parts["imp_min"]
                          + sum(COEFF[n] * parts[n] for n in ("st", "lw", *ADV)))
        return parts["total"], parts

    def ascend(adv, g, lr):  # [S15] Adam ascent, eps outside the sqrt, then clamp
        src, m, v, count = adv
        count += 1
        m = {s: 0.9 * m[s] + 0.1 * g[s] for s in src}
        v = {s: 0.999 * v[s] + 0.001 * g[s] ** 2 for s in src}
        src = {s: jnp.clip(src[s] + lr * (m[s] / (1 - 0.9 ** count))
                           / (jnp.sqrt(v[s] / (1 - 0.999 ** count)) + 1e-8), 0, 1) for s in src}
        return src, m, v, count

    P0 = {p: {"linear1": getattr(state.components, p)["linear1"],
              "hidden_layers.0": getattr(state.components, p)["hidden_layers.0"]}
          for p in ("V", "U")}
    V0, U0 = untie(P0)
    lower0 = jax.lax.stop_gradient({s: _lower(v) for s, v in ci_logits(state.ci_fn, V0).items()})
    advs = {}
    for n, a in ADV.items():  # [S13, S24] warmup ascents, components and CI detached
        A = state.adversaries[n]
        adv = (dict(A.sources), dict(A.m), dict(A.v), float(A.step_count))
        for _ in range(a["n_warmup"]):
            g = jax.grad(lambda src: _mse(masked(V0, U0, source_masks(lower0, src)), clean))(
                adv[0])
            adv = ascend(adv, g, a["lr"])
        advs[n] = adv
    (_, parts), (g_comp, g_src, g_ci) = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(
        P0, {n: a[0] for n, a in advs.items()}, state.ci_fn)
    for n, a in ADV.items():  # [S14] the final ascent: the fused backward / coeff
        advs[n] = ascend(advs[n], {s: g / COEFF[n] for s, g in g_src[n].items()}, a["lr"])

    for name, value in parts.items():
        assert float(metrics[f"train/loss/{name}"]) == pytest.approx(float(value), rel=1e-4), name
    norm = float(np.sqrt(sum(float(jnp.sum(g ** 2)) for g in jax.tree.leaves(g_comp))))
    assert float(metrics["train/grad_norms/summary/components"]) == pytest.approx(norm, rel=1e-4)
    for n in ADV:
        A = new.adversaries[n]
        src, m, v, count = advs[n]
        assert float(A.step_count) == count == 2 * (ADV[n]["n_warmup"] + 1)
        _assert_close(f"{n} sources", A.sources, src, 3e-3)
        _assert_close(f"{n} m", A.m, m, 1e-2)
        _assert_close(f"{n} v", A.v, v, 1e-3)
    # the gradients the optimizers took, from Adam's first moment: mu = 0.9 mu' + 0.1 g
    def taken(new_opt, old_opt):
        return jax.tree.map(lambda a, b: (a - 0.9 * b) / 0.1, new_opt[0].mu, old_opt[0].mu)

    g_pkg = taken(new.opt_components, state.opt_components)
    clip = min(1.0, CLIP / (norm + 1e-6))  # [S19]
    _assert_close("component gradients (clipped)",
                  {p: {s: getattr(g_pkg, p)[s] for s in P0[p]} for p in P0},
                  jax.tree.map(lambda g: g * clip, g_comp), 3e-3)
    _assert_close("CI fn gradients", taken(new.opt_ci_fn, state.opt_ci_fn), g_ci, 3e-3)
    np.testing.assert_array_equal(new.components.V["linear2"], new.components.U["linear1"].T)
