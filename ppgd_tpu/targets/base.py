"""The Target protocol (SPEC 2): a frozen model whose decomposed weights are `sites`.

A target implements `forward(inputs, site_fn)`, calling `site_fn(name, x, W)` wherever the
frozen model computes `x @ W_s`. Everything SPEC 2 names is derived from that one method
here, so every target gets the same clean / masked / tap semantics:

- clean_output: every site is the frozen `x @ W` [S3];
- masked_forward: live sites run `site_out` (components, mask, delta, route); non-live
  sites run the frozen `x @ W` and never touch V/U [S2];
- read_activations: the clean-path input of each requested site [S4].
The target is an equinox module passed to jit as an ARGUMENT, never closed over.
"""

from __future__ import annotations

from typing import Callable, ClassVar, NamedTuple

import equinox as eqx
import jax
import numpy as np

from ppgd_tpu import axes
from ppgd_tpu.decomp.divergence import mse
from ppgd_tpu.targets.lowrank import dense, lift, linear, select_rows

SiteFn = Callable[[str, jax.Array, jax.Array], jax.Array]


def nonfinite(tensors: dict) -> list[str]:
    """A target check's reasons for the tensors holding a NaN or an infinity (comparisons
    with NaN are False, so a check must look for them rather than let them pass)."""
    return [f"tensor {k!r} has non-finite values" for k, v in tensors.items()
            if not bool(np.all(np.isfinite(np.asarray(v))))]


class SiteMask(NamedTuple):
    """Masks of one live site. `delta` None = no delta channel; `route` None = routed
    everywhere (otherwise a bool [*leading]: decomposed where True, frozen elsewhere)."""

    mask: jax.Array  # [*leading, C] (or broadcastable)
    delta: jax.Array | None = None  # [*leading]
    route: jax.Array | None = None  # [*leading] bool


MaskThunk = Callable[[], SiteMask]


def frozen(name: str, x, W: jax.Array):
    """[S3] a site as the frozen model computes it, x @ W: the site fn of a plain forward."""
    return linear(x, W)


def site_out(x, W, V, U, m: SiteMask):
    """SPEC 2: y = ((x V) * mask) U + (x Δ) * delta_mask, Δ = W - V U; routed or frozen.

    With x Δ = x W - (x V) U and a per-position delta mask d this is
    ((x V) * (mask - d)) U + (x W) d: one product with U instead of two, and no d_in x d_out
    Δ is ever formed. A factored x (targets/lowrank.py) gives a factored y.
    """
    inner = dense(linear(x, V))
    mask = m.mask.astype(inner.dtype)  # fp32 sources must not promote a bf16 forward [N2]
    if m.delta is None:
        y = linear(lift(inner * mask, x), U)
    else:
        d = m.delta[..., None].astype(inner.dtype)
        y = linear(lift(inner * (mask - d), x), U) + linear(x, W) * d
    if m.route is not None:
        y = select_rows(m.route[..., None], y, linear(x, W))
    return y


class Target(eqx.Module):
    """Base class: subclasses define `site_weights`, `forward` and the toy metadata, and
    declare their weights' logical axes on their fields (ppgd_tpu/axes.py)."""

    # The logical axes of an input batch: [B, n] for position-less toys (`leading_shape`).
    input_axes: ClassVar[axes.Axes] = axes.Axes((axes.ROWS, "features"))

    def site_weights(self) -> dict[str, jax.Array]:
        """{site: W [d_in, d_out]} in canonical site order."""
        raise NotImplementedError

    def forward(self, inputs: jax.Array, site_fn: SiteFn) -> jax.Array:
        raise NotImplementedError

    @property
    def site_names(self) -> tuple[str, ...]:
        return tuple(self.site_weights())

    def clean_output(self, inputs):
        """[S3] the recon target: the frozen forward, gradient-stopped."""
        out = self.forward(inputs, frozen)
        return jax.lax.stop_gradient(out)

    def read_activations(self, inputs, wanted) -> dict[str, jax.Array]:
        """[S4] clean-path input of every site in `wanted`, gradient-stopped."""
        taps = {}

        def record(name, x, W):
            if name in wanted:
                taps[name] = jax.lax.stop_gradient(x)
            return frozen(name, x, W)

        self.forward(inputs, record)
        return {k: taps[k] for k in wanted}

    def masked_forward(self, inputs, components, masks: dict[str, "SiteMask | MaskThunk"]):
        """[S2] live sites = keys of `masks`; everything else is the frozen path.

        A mask given as a thunk is built inside the forward, at its site: a rematerialised
        layer then redraws it in the backward instead of keeping [*leading, C] masks alive.
        """

        def fn(name, x, W):
            if name not in masks:
                return frozen(name, x, W)
            m = masks[name]
            m = m() if callable(m) else m
            return site_out(x, W, components.V[name], components.U[name], m)

        return self.forward(inputs, fn)

    def tap_widths(self) -> dict[str, int]:
        """{tap: width} of every tap `read_activations` offers (toys: each site's input);
        from shapes, so a target of ShapeDtypeStructs (`ppgd-tpu compile`) has them too."""
        return {s: W.shape[0] for s, W in site_shapes(self).items()}

    def divergence(self, masked, clean):
        """Recon divergence (SPEC 4): MSE for toys; sequence targets override with KL [S25]."""
        return mse(masked, clean)

    def leading_shape(self, batch_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The leading axes of CI and masks: [B] for position-less toys ([B, n] inputs)."""
        return tuple(batch_shape[:-1])

    def weight_deltas(self, components) -> dict[str, jax.Array]:
        return {s: W - components.V[s] @ components.U[s] for s, W in self.site_weights().items()}

    # ------------------------------------------------------------ toy metadata (eval)
    @property
    def n_features(self) -> int | None:
        """Known sparse input features (toys) for the one-hot evals; None for LMs."""
        return None

    @property
    def live_row_probability(self) -> float | None:
        """P(a data row is not all zero): sizes the live-rows recon (decomp/live_rows.py).
        Toys draw each of their n_features on with `feature_probability`; None: unknown."""
        p = getattr(self, "feature_probability", None)
        return None if p is None or self.n_features is None else 1.0 - (1.0 - p) ** self.n_features

    @property
    def identity_ci_sites(self) -> tuple[str, ...]:
        """Sites whose ideal CI pattern on one-hot inputs is the identity."""
        return ()

    @property
    def dense_ci_sites(self) -> dict[str, int]:
        """{site: k} for sites that are one rank-k mechanism (TOYS.md ground truth): ideally
        exactly k components carry them on the one-hot inputs, mostly co-active."""
        return {}

    @property
    def neuron_input_sites(self) -> tuple[str, ...]:
        """Sites whose input is a ReLU layer's output: a privileged basis, where a component
        reading one unit is off (reads 0) whenever that unit is."""
        return ()


def site_shapes(target: Target) -> dict:
    """{site: ShapeDtypeStruct} in the target's canonical site order, from shapes: works on a
    target of arrays or of ShapeDtypeStructs (a toy's sites include W.T, which a struct
    lacks). The order is site_weights()'s own, not the sorted one a pytree result has."""
    order: list[str] = []

    def weights(t):
        w = t.site_weights()
        order.extend(w)
        return w

    shapes = jax.eval_shape(weights, target)
    return {s: shapes[s] for s in order}
