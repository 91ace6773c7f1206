"""The persistent PGD adversary (SPEC 5) and the fresh sign-PGD probe/term.

Sources live in [0, 1] with shape [*scope, C_s + 1]; scope `sc` = 1 on the batch axis
(shared across the batch, one per position), `bsc` = the batch rows (one source per row
and position).
Ascent is Adam then clamp, eps OUTSIDE the sqrt [S15].
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from ppgd_tpu import axes
from ppgd_tpu.config import PersistentPGDTerm
from ppgd_tpu.decomp import rng


def _source_axes(adv: "Adversary") -> tuple:
    """Logical axes of a source (and its moments) [*scope, C_s + 1]: `sc` shared by every
    batch row, `bsc` split with them."""
    return (axes.SHARED_ROWS if adv.scope == "sc" else axes.ROWS, "channels")


class Adversary(eqx.Module):
    """State of one persistent term [S23]: sources, Adam moments (fp32), step count."""

    sources: dict[str, jax.Array] = axes.field(_source_axes)
    m: dict[str, jax.Array] = axes.field(_source_axes)
    v: dict[str, jax.Array] = axes.field(_source_axes)
    step_count: jax.Array = axes.field()  # fp32 scalar
    scope: str = eqx.field(static=True)  # `sc` or `bsc`


def scope_shape(scope: str, leading: tuple[int, ...]) -> tuple[int, ...]:
    """`sc`: 1 on the batch axis (positions kept); `bsc`: the full leading shape."""
    return (1, *leading[1:]) if scope == "sc" else tuple(leading)


def init(key, scope: str, leading: tuple[int, ...], C: dict[str, int]) -> Adversary:
    shape = scope_shape(scope, leading)
    src = {s: rng.uniform(jax.random.fold_in(key, i), (*shape, c + 1))
           for i, (s, c) in enumerate(C.items())}
    m = {s: jnp.zeros_like(x) for s, x in src.items()}
    v = {s: jnp.zeros_like(x) for s, x in src.items()}  # distinct buffers: state is donated
    return Adversary(sources=src, m=m, v=v, step_count=jnp.float32(0.0), scope=scope)


def ascend(adv: Adversary, grad: dict[str, jax.Array], cfg: PersistentPGDTerm, lr) -> Adversary:
    """[S15] t = count + 1; Adam moments; sources += lr m_hat / (sqrt(v_hat) + eps); clamp."""
    t = adv.step_count + 1.0
    b1, b2 = cfg.beta1, cfg.beta2
    m = {s: b1 * adv.m[s] + (1 - b1) * grad[s] for s in adv.sources}
    v = {s: b2 * adv.v[s] + (1 - b2) * jnp.square(grad[s]) for s in adv.sources}
    src = {}
    for s, x in adv.sources.items():
        m_hat = m[s] / (1 - b1 ** t)
        v_hat = v[s] / (1 - b2 ** t)
        src[s] = jnp.clip(x + lr * m_hat / (jnp.sqrt(v_hat) + cfg.eps), 0.0, 1.0)
    return Adversary(sources=src, m=m, v=v, step_count=t, scope=adv.scope)


def idle_ascents(adv: Adversary, n: int, cfg: PersistentPGDTerm, lr) -> Adversary:
    """`n` ascents with a zero gradient in one pass: those of the rows whose recon divergence
    cannot move (decomp/live_rows.py), which still step - the moments decay and the sources
    follow them. [S15] with g = 0: after j steps m = b1^j m, v = b2^j v, so
    sqrt(v_hat_j) = sqrt(v) sqrt(b2^j / (1 - b2^t_j)): one sqrt per element, not n; and every
    step moves a source the same way (the sign of lr m, one lr for the step's ascents), so
    clamping once at the end is clamping after each step."""
    b1, b2 = cfg.beta1, cfg.beta2
    src = {}
    for s, x in adv.sources.items():
        root = jnp.sqrt(adv.v[s])
        move = 0.0
        for j in range(1, n + 1):
            t = adv.step_count + j
            c = lr * b1 ** j / (1 - b1 ** t)
            q = jnp.sqrt(b2 ** j / (1 - b2 ** t))
            move = move + c * adv.m[s] / (root * q + cfg.eps)
        src[s] = jnp.clip(x + move, 0.0, 1.0)
    return Adversary(sources=src, m={s: b1 ** n * m for s, m in adv.m.items()},
                     v={s: b2 ** n * v for s, v in adv.v.items()},
                     step_count=adv.step_count + n, scope=adv.scope)


def sign_pgd(key, scope: str, leading, C: dict[str, int], n_steps: int, step_size: float,
             objective):
    """Fresh sign-PGD: sources ~ U[0,1], `n_steps` of clamp(src + step * sign(grad)).

    `objective(sources) -> scalar` is the recon divergence to push UP. Returns the final
    sources, gradient-stopped (the caller evaluates / trains against them).
    """
    src = init(key, scope, leading, C).sources
    grad_fn = jax.grad(objective)

    def body(_, s):
        g = grad_fn(s)
        return {k: jnp.clip(s[k] + step_size * jnp.sign(g[k]), 0.0, 1.0) for k in s}

    src = jax.lax.fori_loop(0, n_steps, body, src)
    return jax.lax.stop_gradient(src)
