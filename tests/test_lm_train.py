"""The LM path through the training loop: token-store batches [W1, D3], the LM fast tier
(CE / KL per mask kind, CI-L0), figures, refusals before compute, the production configs
built abstractly, and a tiny tokenize -> pretrain -> train run through the CLI."""

import glob
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ppgd_tpu
from ppgd_tpu import cli
from ppgd_tpu.config import load
from ppgd_tpu.data import lm as data_lib
from ppgd_tpu.data.schedule import train_eval_schedules
from ppgd_tpu.data.tokens import TokenStore
from ppgd_tpu.decomp import ci_transformer
from ppgd_tpu.step import Decomposer
from ppgd_tpu.targets import build, lm_pretrain
from ppgd_tpu.targets import llama_simple_mlp as lm

def _cfg(corpus, **over):
    return load(corpus["config"], {"target.path": corpus["target"],
                                   "data.store": corpus["store"], **over})


def test_batches_are_store_rows_of_the_schedule_and_skip_the_held_out_rows(corpus):
    """[W1, C1] batch j = rows of BatchSchedule(seed, j) minus their last token; the eval
    batch is the held-out schedule's batch 0, its labels the inputs shifted by one."""
    cfg = _cfg(corpus)
    data = data_lib.LMData(cfg)
    st = TokenStore.open(corpus["store"])
    train, held = train_eval_schedules(st.n_rows, train_batch=8, train_seed=3, eval_batch=16,
                                       eval_seed=5, eval_rows=32)
    for j in (0, 1, 7):
        x = data.batch(j)
        assert x.shape == (8, 16) and x.dtype == jnp.int32
        np.testing.assert_array_equal(x, st.read_rows(train.rows(j))[:, :-1])
        assert train.rows(j).min() >= 32  # never a held-out row
    assert not np.array_equal(data.batch(0), data.batch(1))
    np.testing.assert_array_equal(data_lib.LMData(cfg).batch(4), data.batch(4))
    rows = st.read_rows(held.rows(0))
    np.testing.assert_array_equal(data.eval_batch, rows[:, :-1])
    np.testing.assert_array_equal(data.eval_labels, rows[:, 1:])


@pytest.mark.parametrize("over,needle", [
    ({"data.store": ""}, "data.store: required when target.kind is 'llama_simple_mlp'"),
    ({"data.store": "/nonexistent/store"}, "data.store: no token store at /nonexistent/store"),
    ({"target.llama_simple_mlp.max_seq_len": 8}, "max_seq_len: 8 is shorter than the "
                                                 "sequences of the token store"),
    ({"data.eval_rows": 4000}, "data.eval_rows: 4000 held-out rows leave fewer than one batch"),
    ({"data.batch_size": 40000}, "data.batch_size: 40000 rows exceed the"),  # said eval_rows
    ({"eval.batch_size": 64}, "eval.batch_size: 64 exceeds the 32 rows eval draws from"),
])
def test_lm_data_is_refused_by_field_before_compute(corpus, over, needle, capsys, tmp_path):
    argv = ["train", f"--config={corpus['config']}", f"--target.path={corpus['target']}",
            f"--data.store={corpus['store']}", f"--run_dir={tmp_path / 'r'}"]
    argv += [f"--{k}={v}" for k, v in over.items()]
    assert cli.run(argv) == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_a_toy_target_refuses_a_store(corpus, capsys, tmp_path):
    assert cli.run(["train", f"--data.store={corpus['store']}",
                    f"--run_dir={tmp_path / 'r'}"]) == 2
    assert "data.store" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_tiny_lm_decomposition_through_the_cli(corpus, tmp_path):
    run_dir = tmp_path / "run"
    assert cli.run(["train", f"--config={corpus['config']}",
                    f"--target.path={corpus['target']}", f"--data.store={corpus['store']}",
                    f"--run_dir={run_dir}"]) == 0
    rows = [json.loads(ln) for ln in open(run_dir / "metrics.jsonl")]
    train = [r for r in rows if "train/loss/total" in r]
    assert [r["step"] for r in train] == [10, 20]
    evals = [r for r in rows if "eval/ce/clean" in r]
    assert [r["step"] for r in evals] == [10, 20]
    summary = json.load(open(run_dir / "summary.json"))
    sites = ["h.0.mlp.c_fc", "h.0.mlp.down_proj", "h.1.mlp.c_fc", "h.1.mlp.down_proj"]
    kinds = ["unmasked", "ci_masked", "stochastic", "rounded", "zero", "pgd"]
    keys = ["eval/ce/clean", *[f"eval/{m}/{k}" for m in ("ce", "kl") for k in kinds],
            *[f"eval/ci_l0/{s}" for s in sites]]
    for key in keys:
        assert key in summary and np.isfinite(summary[key]), key
    assert not any(k.startswith("eval/recon/") for k in summary)  # LMs name it eval/kl
    for s in sites:
        assert 0 <= summary[f"eval/ci_l0/{s}"] <= 16
    # The frozen model's CE is the pretraining loss on the same rows (an independent CE).
    cfg = _cfg(corpus)
    target = build.load(cfg.target, corpus["target"])
    st = TokenStore.open(corpus["store"])
    _, held = train_eval_schedules(st.n_rows, train_batch=8, train_seed=3, eval_batch=16,
                                   eval_seed=5, eval_rows=32)
    rows = jnp.asarray(st.read_rows(held.rows(0)), jnp.int32)
    for r in train:  # throughput: B = 8 rows of T = seq_len - 1 input tokens per step
        step_s = r["train/perf/step_time_s"]
        assert r["train/perf/examples_per_s"] == pytest.approx(8 / step_s)
        assert r["train/perf/tokens_per_s"] == pytest.approx(8 * (st.seq_len - 1) / step_s)
    assert summary["eval/ce/clean"] == pytest.approx(
        float(lm_pretrain.next_token_loss(target, rows)), rel=1e-5)
    # ppgd_tpu.load_run's CI fn on the same rows' inputs: the run's own CI L0, per position
    inputs = np.asarray(rows)[:, :-1]
    ci = ppgd_tpu.load_run(str(run_dir)).ci(inputs)
    for s in sites:
        assert ci[s].shape == (*inputs.shape, 16)
        assert np.mean(np.sum(ci[s] > 0.1, -1)) == pytest.approx(summary[f"eval/ci_l0/{s}"],
                                                                rel=1e-5)
    # Zero-ablating both MLPs of a trained LM costs more than its components with masks 1.
    assert summary["eval/kl/zero"] > summary["eval/kl/unmasked"]
    assert summary["eval/ce/zero"] > summary["eval/ce/clean"]
    figs = set(os.listdir(run_dir / "figures"))
    assert {"ci_histograms.png", "activation_density.png", "component_norms.png"} <= figs
    assert "ci_per_feature.png" not in figs  # toy-only


def test_activation_density_counts_positions_per_component():
    from ppgd_tpu.eval import activation_density

    ci = np.zeros((2, 3, 4))
    ci[0, :, 1] = 0.5  # component 1 active at 3 of 6 positions
    ci[:, :, 3] = 1.0  # component 3 at all of them
    ci[1, 2, 0] = 0.05  # below the threshold
    np.testing.assert_allclose(activation_density(ci, 0.1), [0, 0.5, 0, 1])


PILE_CONFIGS = sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "configs",
                                             "pile_4L_*.yaml")))


def test_the_production_configs_are_found():
    assert PILE_CONFIGS  # found from any working directory


@pytest.mark.parametrize("path", PILE_CONFIGS, ids=os.path.basename)
def test_production_configs_validate_and_build_abstractly(path):
    """Target init and Decomposer init traced with jax.eval_shape: no real allocation."""
    cfg = load(path)
    target = jax.eval_shape(lambda: lm.init(cfg.target.llama_simple_mlp, jax.random.key(0)))
    dec = Decomposer(cfg, target, (cfg.data.batch_size, cfg.target.llama_simple_mlp.max_seq_len))
    state = jax.eval_shape(dec.init, target)
    assert dec.leading == (64, 512) and len(dec.sites) == 24
    assert state.ci_fn.chunks == tuple(tuple(dec.sites[6 * L:6 * L + 6]) for L in range(4))
    assert state.ci_fn.input_names == ("resid.0", "resid.1", "resid.2", "resid.3")
    n_target = sum(x.size for x in jax.tree.leaves(target))
    n_ci = ci_transformer.n_params(state.ci_fn)
    assert n_ci > 10 * n_target
    for adv in state.adversaries.values():  # bsc: one source per row and position (SPEC 5)
        assert all(v.shape[:2] == (64, 512) for v in adv.sources.values())
