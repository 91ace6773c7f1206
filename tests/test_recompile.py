"""No recompiles after the first step of each variant (issue 8): every step variant is
compiled once per run; later steps, replay windows and log steps reuse the executables."""

import logging

import jax
import pytest

from ppgd_tpu import config
from ppgd_tpu.engine import Trainer


@pytest.mark.parametrize("mode", ["every", "first", "mean"])
def test_steps_after_the_first_window_never_compile(mode, caplog):
    k = 1 if mode == "every" else 2
    cfg = config.load(None, {"decomp.steps": "12", "data.batch_size": "64",
                             "data.train_batch_replay": str(k), "data.replay_ci_update": mode,
                             "decomp.ci_fn.detach_inputs": "true"})
    trainer = Trainer(cfg)
    state = trainer.init_state()

    def run(steps):
        nonlocal state
        for s in steps:
            state, m = trainer.replay.step(s, state, trainer.target, trainer.batch(s // k))
        jax.block_until_ready(state)

    run(range(0, 2 * k))  # the first windows compile every variant they use
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.DEBUG):
            run(range(2 * k, 12))
    finally:
        jax.config.update("jax_log_compiles", False)
    compiles = [r.getMessage() for r in caplog.records if "ompil" in r.getMessage()]
    assert compiles == []
