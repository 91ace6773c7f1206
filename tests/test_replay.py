"""Replay windows (SPEC 7) on the TMS toy: the step variants [W3], the controller's modes
[W1, W2], the in-step CI LR [W4] and donation [W5]."""

import math
import typing
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_same, config, leaves
from ppgd_tpu.config import Config, ConfigError, TMSConfig, load
from ppgd_tpu.decomp.schedules import schedule_value
from ppgd_tpu import replay
from ppgd_tpu.config import DataConfig
from ppgd_tpu.replay import ReplayController
from ppgd_tpu.decomp.live_rows import Subset
from ppgd_tpu.step import CIRows, Decomposer, Envelope
from ppgd_tpu.targets import tms

K = 4


def _cfg(mode="every", k=K, ci_kind="per_component_mlp", ppgd=True, rows=64):
    ppgd_term = {"loss.persistent_pgd.ppgd.coeff": 0.5, "loss.persistent_pgd.ppgd.scope": "bsc",
                 "loss.persistent_pgd.ppgd.n_warmup": 1} if ppgd else {}
    return config({
        "data.batch_size": rows, "data.train_batch_replay": k, "data.replay_ci_update": mode,
        **ppgd_term, "decomp.steps": 40, "decomp.sites.*": 6,
        "decomp.ci_fn.detach_inputs": True, "decomp.ci_fn.kind": ci_kind,
        "decomp.lr_ci_fn.kind": "cosine", "decomp.lr_ci_fn.value": 1e-2,
        "decomp.lr_ci_fn.warmup_steps": 8, "decomp.lr_ci_fn.final_frac": 0.1})


@pytest.fixture(scope="module")
def target():
    return tms.init(TMSConfig(), jax.random.key(0))


def _setup(target, mode="every", ci_kind="per_component_mlp", ppgd=True):
    cfg = _cfg(mode, ci_kind=ci_kind, ppgd=ppgd)
    dec = Decomposer(cfg, target, (64, 5))
    state = dec.init(target)
    batch = target.sample(jax.random.key(7), 64)
    return cfg, dec, state, batch


def test_W3_repeat_matches_full_for_components_and_adversary_and_spares_ci(target):
    _, dec, state, batch = _setup(target)
    full, _ = dec.full(state, target, batch)
    env = dec.compute_ci(target, state, batch)
    rep, metrics = dec.repeat((target, env), state, batch)
    assert_same(rep.components, full.components, rtol=1e-6, atol=1e-9)
    assert_same(rep.adversaries, full.adversaries, rtol=1e-6, atol=1e-9)
    assert_same(rep.ci_fn, state.ci_fn)  # bit-untouched
    assert_same(rep.opt_ci_fn, state.opt_ci_fn)
    assert "train/grad_norms/summary/ci_fn" not in metrics  # absent when the CI fn is not updated
    assert "train/loss/imp_min" in metrics  # still evaluated from the cached upper


def test_compute_ci_equals_the_full_step_envelope(target):
    _, dec, state, batch = _setup(target)
    _, env, _ = dec.full_keep(state, target, batch)
    assert_same(dec.compute_ci(target, state, batch), env, rtol=1e-6, atol=1e-7)


def _run(target, mode, steps, ci_kind="per_component_mlp", ppgd=True, rows=64,
         skip_dead_rows=True):
    cfg = _cfg(mode, ci_kind=ci_kind, ppgd=ppgd, rows=rows)
    dec = Decomposer(cfg, target, (rows, 5))
    dec.skip_dead_rows = skip_dead_rows
    ctl = ReplayController(dec)
    state = jax.jit(dec.init)(target)  # distinct buffers, as the engine makes them
    states, metrics = [], []
    for s in range(steps):
        states.append(jax.tree.map(jnp.copy, state))  # the controller donates `state`
        state, m = ctl.step(s, state, target, target.sample(jax.random.key(s // K), rows))
        metrics.append(jax.device_get(m))
    return dec, state, states, metrics


def test_W2_last_follows_first_on_components_and_sources_and_its_update_is_a_plain_step(target):
    _, _, first_states, _ = _run(target, "first", K)
    dec, last_end, last_states, _ = _run(target, "last", K)
    # before any CI update both modes use the pre-window envelope: same V/U/source trajectory
    # up to the last step of the window, where `last` trains the CI fn
    for t in range(1, K):
        assert_same(last_states[t].components, first_states[t].components, rtol=1e-6, atol=1e-9)
        # two programs (compute_ci vs the step's own CI forward) fuse the CI fn differently:
        # ulp-level envelope differences, which Adam's normalisation lifts to ~1e-8 absolute
        assert_same(last_states[t].adversaries, first_states[t].adversaries, rtol=1e-6,
                     atol=1e-7)
    # its CI update equals a plain step's at the same pre-step state
    plain, _ = dec.full(last_states[K - 1], target, target.sample(jax.random.key(0), 64))
    assert_same(last_end.ci_fn, plain.ci_fn, rtol=1e-6, atol=1e-9)
    assert_same(last_end.components, plain.components, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("ci_kind", ["per_site_mlp", "per_component_mlp"])
def test_W2_mean_update_is_the_mean_of_the_window_ci_gradients(target, ci_kind):
    """The per-site CI fn reads taps only; the per-component one also reads V, which moves
    inside the window: its update is taken at the V that made the envelope, not the V of the
    window's last step (that would not be the gradient of the window's loss)."""
    dec, mean_end, states, metrics = _run(target, "mean", K, ci_kind=ci_kind, ppgd=False)
    batch = target.sample(jax.random.key(0), 64)
    mu = lambda st: leaves(st.opt_ci_fn[0].mu)  # fresh Adam: first moment = (1 - b1) g

    # SPEC 7: the window-mean envelope cotangent pulled back through ONE CI-fn vjp. Build it
    # from the pieces: per-step cotangents d loss / d envelope at each pre-step state.
    env = dec.compute_ci(target, states[0], batch)
    every = Subset.all(64)
    cots = []
    for st in states:
        loss = lambda e: dec._losses(dec._inputs(st.step, target, batch), every,
                                     CIRows(every.take, None), st.components, {}, e)[0]
        cots.append(jax.grad(loss)(env))
    mean_cot = jax.tree.map(lambda *xs: sum(xs) / K, *cots)
    def envelope_of(ci_fn, components):
        ci = dec.ci(ci_fn, components, target, batch)
        return Envelope(ci.lower, ci.upper)

    _, vjp = jax.vjp(lambda f: envelope_of(f, states[0].components), states[-1].ci_fn)
    want = [0.1 * x for x in leaves(vjp(mean_cot)[0])]
    for got, w in zip(mu(mean_end), want):
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6 * np.abs(w).max())
    if ci_kind == "per_component_mlp":  # the window's V moved: the other point differs
        _, at_last = jax.vjp(lambda f: envelope_of(f, states[-1].components), states[-1].ci_fn)
        wrong = [0.1 * x for x in leaves(at_last(mean_cot)[0])]
        assert max(np.abs(w - x).max() / np.abs(w).max() for w, x in zip(want, wrong)) > 1e-3
        return

    # ... which is the mean of the k per-step CI gradients up to the one non-linearity of
    # the pull-back: lower_leaky_hard's backward at x <= 0 depends on the cotangent's sign [S6].
    per_step = [mu(dec.full(st, target, batch)[0]) for st in states]
    for got, *ps in zip(mu(mean_end), *per_step):
        np.testing.assert_allclose(got, np.mean(ps, 0), atol=1e-2 * np.abs(got).max())
        assert not np.allclose(got, ps[0], atol=1e-2 * np.abs(got).max())  # not one step's
    assert int(mean_end.opt_ci_fn[0].count) == 1  # ONE update per window
    assert ["train/grad_norms/summary/ci_fn" in m for m in metrics] == [False] * (K - 1) + [True]


def _live_rows_bound(rows, tms_cfg):
    """live_rows.sizes' documented rule, by hand: a row is live unless all n_features are
    off, p = 1 - (1 - feature_probability)^n_features; the bound is the binomial mean
    rows p + 6 sd sqrt(rows p (1 - p)), rounded up to a multiple of 8."""
    p = 1.0 - (1.0 - tms_cfg.feature_probability) ** tms_cfg.n_features
    mean, sd = rows * p, math.sqrt(rows * p * (1.0 - p))
    return 8 * math.ceil((mean + 6.0 * sd) / 8)


@pytest.mark.parametrize("mode", ["first", "last", "mean"])
def test_W2_replay_variants_on_the_live_rows_end_where_their_all_rows_runs_end(target, mode):
    """live_rows.py inside replay windows: 256 rows compile the live-rows branch (TMS 5-2:
    104 rows, the mean + 6 sd bound) into every variant a mode runs (full_keep, repeat,
    mean_accum, mean_update), and two windows end where the same run on every row ends, to
    float reassociation."""
    k = _live_rows_bound(256, TMSConfig())
    assert k <= 256 // 2  # the rule keeps a live-rows branch only up to half the batch
    dec, live_end, _, _ = _run(target, mode, 2 * K, rows=256)
    assert dec.live_sizes == (k, 256) and dec.skip_dead_rows
    _, full_end, _, _ = _run(target, mode, 2 * K, rows=256, skip_dead_rows=False)
    assert_same(live_end, full_end, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("mode", ["first", "last", "mean"])
def test_W4_ci_lr_is_the_schedule_at_the_global_step(target, mode):
    cfg = _cfg(mode)
    dec, _, states, metrics = _run(target, mode, 3 * K)
    updated = [s for s, m in enumerate(metrics) if "train/lr/ci_fn" in m]
    assert len(updated) == 3
    for s in updated:
        want = float(schedule_value(cfg.decomp.lr_ci_fn, s, cfg.decomp.steps))
        assert metrics[s]["train/lr/ci_fn"] == pytest.approx(want, rel=1e-6)
        assert s % K == (0 if mode == "first" else K - 1)
    # An Adam update moves a parameter by about lr(s) (|m/sqrt(v)| ~ 1), not by lr(update
    # count). The second update tells them apart in every mode: in `first` the first one is
    # at s = 0, where both are lr(0) = 0 (warmup), so it could not fail.
    s = updated[1]  # (the run's 3 windows: states[s + 1] exists)
    delta = np.abs(np.asarray(states[s + 1].ci_fn.b2["linear1"] - states[s].ci_fn.b2["linear1"]))
    lr = float(schedule_value(cfg.decomp.lr_ci_fn, s, cfg.decomp.steps))
    by_count = float(schedule_value(cfg.decomp.lr_ci_fn, 1, cfg.decomp.steps))
    assert lr > 3 * by_count  # (warmup 8: 4x in `first`, 7x in `last` and `mean`)
    # (measured: 1.0 lr in `first`, 0.7 lr in `last` and `mean`; by count: <= 0.25 lr)
    assert 0.45 * lr < np.median(delta) < 1.5 * lr, (np.median(delta), lr)


def test_W1_every_is_bitwise_the_plain_step(target):
    _, dec, _, _ = _setup(target, "every")
    plain = jax.jit(dec.full, donate_argnums=0)
    _, ctl_end, _, _ = _run(target, "every", 3)
    s = jax.jit(dec.init)(target)
    for i in range(3):
        s, _ = plain(s, target, target.sample(jax.random.key(i // K), 64))
    assert_same(ctl_end, s)


def test_W5_no_unusable_donation_and_repeat_peak_memory_not_above_full(target):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for mode in ("first", "last", "mean"):
            _run(target, mode, K + 1)
    donated = [str(w.message) for w in caught if "donat" in str(w.message).lower()]
    assert donated == []
    _, dec, state, batch = _setup(target)
    env = dec.compute_ci(target, state, batch)
    full = jax.jit(dec.full, donate_argnums=0).lower(state, target, batch).compile()
    rep = jax.jit(dec.repeat, donate_argnums=1).lower((target, env), state, batch).compile()
    assert rep.memory_analysis().temp_size_in_bytes <= full.memory_analysis().temp_size_in_bytes


def test_refused_replay_configs():
    with pytest.raises(ConfigError, match="needs data.train_batch_replay >= 2"):
        load(None, {"data.replay_ci_update": "mean"})
    with pytest.raises(ConfigError, match="decomp.ci_fn.detach_inputs: must be true"):
        load(None, {"data.replay_ci_update": "first", "data.train_batch_replay": "4"})
    with pytest.raises(ConfigError, match="multiple of data.train_batch_replay"):
        load(None, {"data.train_batch_replay": "3"})
    ok = load(None, {"data.replay_ci_update": "first", "data.train_batch_replay": "4",
                     "decomp.ci_fn.detach_inputs": "true"})
    assert ok.data.replay_ci_update == "first"


def test_the_module_docstring_table_is_the_policy_table():
    """replay.py's table (SPEC 7's modes [W2]) is POLICIES, row for row, and the config
    offers exactly its modes."""
    rows = {}
    for line in replay.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and cells[0] in typing.get_args(
                typing.get_type_hints(DataConfig)["replay_ci_update"]):
            rows[cells[0]] = cells[1:]
    assert set(rows) == set(replay.POLICIES) == {"every", "first", "last", "mean"}
    for mode, (t0, mid, last, opens, holds, rebuilds) in rows.items():
        p = replay.POLICIES[mode]
        assert p.variants == (t0, mid, last), mode
        assert p.opens == (opens == "yes"), mode
        names = {"V": "envelope_V"}
        assert p.holds == tuple(names.get(h, h) for h in holds.split(", ") if h != "-"), mode
        assert p.rebuilds == (rebuilds == "envelope"), mode
        assert set(p.programs()) <= set(replay.CALLS) | {"compute_ci"}


@pytest.mark.parametrize("mode,reads_V,held,stored", [
    ("every", True, (), ()),
    ("first", False, ("envelope",), ("envelope",)),
    ("last", False, ("envelope",), ()),
    ("last", True, ("envelope",), ("envelope",)),
    ("mean", False, ("envelope", "accumulator"), ("accumulator",)),
    ("mean", True, ("envelope", "accumulator", "envelope_V"),
     ("envelope", "accumulator", "envelope_V"))])
def test_W6_a_checkpoint_stores_what_a_restore_cannot_rebuild(mode, reads_V, held, stored):
    """The envelope is rebuilt from the CI fn where it has not moved since t = 0 and does not
    read V (V moves every step); the accumulator and the envelope's V never can be."""
    p = replay.POLICIES[mode]
    assert p.held(reads_V) == held and p.stored(reads_V) == stored


def test_ci_updated_follows_the_variant_each_position_runs(target):
    want = {"every": [1, 1, 1, 1], "first": [1, 0, 0, 0], "last": [0, 0, 0, 1],
            "mean": [0, 0, 0, 1]}
    for mode, updated in want.items():
        ctl = ReplayController(Decomposer(_cfg(mode), target, (64, 5)))
        assert [int(ctl.ci_updated(s)) for s in range(K, 2 * K)] == updated, mode


def test_optimizer_state_structure_is_the_same_in_every_mode(target):
    structs = set()
    for mode in ("every", "first", "last", "mean"):
        _, _, state, _ = _setup(target, mode)
        structs.add(jax.tree.structure(state))
    assert len(structs) == 1


# ---------------------------------------------------------------- the same on a tiny LM


def _lm(mode="every"):
    from ppgd_tpu.config import LlamaConfig, from_dict
    from ppgd_tpu.targets import llama_simple_mlp as lm

    cfg = from_dict(Config, {
        "target": {"kind": "llama_simple_mlp"},
        "data": {"batch_size": 2, "train_batch_replay": K, "replay_ci_update": mode},
        "decomp": {"sites": {"h.*.mlp.*": 3, "h.*.attn.q_proj": 2}, "steps": 16,
                   "ci_fn": {"kind": "chunkwise_transformer", "d_model": 16, "n_blocks": 1,
                             "n_heads": 2, "d_mlp": 16}},
        "loss": {"stochastic": {"stoch": {"routing": "uniform_k"}},
                 "persistent_pgd": {"ppgd": {"scope": "bsc", "n_warmup": 1}}},
    })
    t = lm.init(LlamaConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2,
                            d_mlp=24, max_seq_len=8), jax.random.key(0))
    dec = Decomposer(cfg, t, (2, 6))
    batch = jax.random.randint(jax.random.key(1), (2, 6), 0, 32)
    return dec, t, jax.jit(dec.init)(t), batch


def test_W3_on_a_tiny_lm_repeat_matches_full_and_compute_ci_is_its_envelope():
    dec, t, state, batch = _lm()
    full, env_full, _ = jax.jit(dec.full_keep)(state, t, batch)
    env = jax.jit(dec.compute_ci)(t, state, batch)
    assert_same(env, env_full, rtol=1e-5, atol=1e-6)
    rep, metrics = jax.jit(dec.repeat)((t, env), state, batch)
    assert_same(rep.components, full.components, rtol=1e-5, atol=1e-7)
    assert_same(rep.adversaries, full.adversaries, rtol=1e-5, atol=1e-7)
    assert_same(rep.ci_fn, state.ci_fn)
    assert_same(rep.opt_ci_fn, state.opt_ci_fn)
    assert "train/grad_norms/summary/ci_fn" not in metrics


@pytest.mark.parametrize("mode", ["last", "mean"])  # (`first` is the W3 test's full_keep)
def test_W2_on_a_tiny_lm_the_ci_fn_trains_once_per_window(mode):
    dec, t, state, batch = _lm(mode)
    ctl = ReplayController(dec)
    updated = []  # (steps = 16: the cosine LR is 0 only at the run's last step [S20])
    for s in range(2 * K):
        before = jax.tree.map(jnp.copy, state.ci_fn)
        state, m = ctl.step(s, state, t, batch)
        moved = any(not np.array_equal(a, b) for a, b in
                    zip(leaves(before), leaves(state.ci_fn)))
        assert moved == ("train/grad_norms/summary/ci_fn" in m) == ctl.ci_updated(s)
        updated.append(moved)
    assert sum(updated) == 2
