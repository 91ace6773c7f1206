"""No recompiles after the first step of each variant (issue 8): every step variant is
compiled once per run; later steps, replay windows and log steps reuse the executables."""

import logging
import re

import jax
import pytest

from ppgd_tpu import config
from ppgd_tpu.engine import Trainer


VARIANTS = {"full", "full_keep", "compute_ci", "repeat", "mean_accum", "mean_update",
            "zero_accumulator", "copy_V"}


@pytest.mark.parametrize("mode", ["every", "first", "mean"])
def test_each_variant_compiles_once_and_later_windows_never_compile(mode, caplog):
    k = 1 if mode == "every" else 3  # mean: t = 1 accumulates onto t = 0's accumulator
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

    def compiles_during(steps):
        caplog.clear()
        jax.config.update("jax_log_compiles", True)
        try:
            with caplog.at_level(logging.DEBUG):
                run(steps)
        finally:
            jax.config.update("jax_log_compiles", False)
        return [r.getMessage() for r in caplog.records if "ompil" in r.getMessage()]

    # the first windows compile each variant they use ONCE (a second compile of one variant,
    # e.g. on an eagerly made accumulator, would be a wasted compile per run) ...
    first = [re.match(r"Compiling jit\((\w+)\)", m) for m in compiles_during(range(0, 2 * k))]
    variants = [m[1] for m in first if m and m[1] in VARIANTS]
    assert variants and len(variants) == len(set(variants)), variants
    # ... and nothing compiles after them
    assert compiles_during(range(2 * k, 12)) == []
