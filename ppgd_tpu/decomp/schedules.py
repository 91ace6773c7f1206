"""Schedules, the component gradient clip and the AdamW used for every trained leaf.

Two rules optax does not give by default are written out here: the clip scale with its
+1e-6 [S19] and the cosine/linear progress denominator `decay_steps - 1` [S20]. The LR is
applied OUTSIDE the optimizer (unit-LR AdamW, update x lr(global step)), so the optimizer
state has one structure whatever the replay mode and the LR follows the global step [W4].
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from ppgd_tpu.config import Schedule


def schedule_value(s: Schedule, step, total_steps: int):
    """Value of schedule `s` at (global) `step` of a run of `total_steps` steps [S20].

    Warmup: value * step / warmup_steps for step < warmup_steps. Then progress
    (step - warmup) / (decay_steps - 1) with decay_steps = total_steps - warmup_steps, so
    the final value value*final_frac is reached AT step = total_steps - 1. With one decay
    step (decay_steps - 1 = 0) that step is the last: it takes the final value.
    """
    step = jnp.asarray(step, jnp.float32)
    peak = jnp.float32(s.value)
    if s.kind == "constant":
        after = peak
    else:
        denom = total_steps - s.warmup_steps - 1  # decay_steps - 1; config keeps it >= 0
        progress = (jnp.clip((step - s.warmup_steps) / jnp.float32(denom), 0.0, 1.0)
                    if denom > 0 else jnp.float32(1.0))
        end = peak * s.final_frac
        if s.kind == "linear":
            after = peak + (end - peak) * progress
        else:
            after = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    if s.warmup_steps > 0:
        return jnp.where(step < s.warmup_steps, peak * step / s.warmup_steps, after)
    return after


def global_norm(tree) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def clip_by_global_norm(tree, max_norm: float):
    """[S19] scale = min(1, max_norm / (global_norm + 1e-6)); max_norm 0 disables."""
    if max_norm <= 0:
        return tree
    scale = jnp.minimum(1.0, max_norm / (global_norm(tree) + 1e-6))
    return jax.tree.map(lambda g: g * scale, tree)


def adamw(weight_decay: float) -> optax.GradientTransformation:
    """Unit-LR AdamW [S20]: beta (0.9, 0.999), eps 1e-8; the caller multiplies by lr(step)."""
    return optax.chain(
        optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
        optax.add_decayed_weights(weight_decay),
        optax.scale(-1.0),
    )


def apply_update(params, grads, opt_state, opt: optax.GradientTransformation, lr):
    """One AdamW step with the LR applied in-step at the global step [W4]."""
    updates, opt_state = opt.update(grads, opt_state, params)
    params = jax.tree.map(lambda p, u: p + lr * u, params, updates)
    return params, opt_state
