"""Evaluation: a fast scalar tier (jitted, on a cadence, always at the end) and a slow
figure tier (PNG files at the end).

Recon metrics are the divergence of a masked forward against the clean output:
`unmasked` (components only, every mask 1), `ci_masked` (mask = CI lower, no delta),
`stochastic` (the training masks), `pgd` (a fresh sign-PGD probe on a shared source) and
`zero` (every decomposed site outputs 0) for scale. LMs name them `eval/kl/<kind>`, add
`rounded` (mask = round(CI lower)) and the next-token CE of every kind and of the clean
model (`eval/ce/<kind>`, `eval/ce/clean`). Toys with known features add, on the
one-hot inputs 0.75 e_i, the CI-L0 there, the identity-CI error and MMCS (TOYS.md,
"Metrics"), the dense-CI error of sites that should be one rank-k mechanism, how
closely the components of a site reading a ReLU layer each read one neuron, and per site
whether its ground truth was recovered (`eval/recovered/<site>`, 1 or 0).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from scipy.optimize import linear_sum_assignment

from ppgd_tpu import storage
from ppgd_tpu.data.toy import EVAL_TAG
from ppgd_tpu.decomp import adversary as adv_lib
from ppgd_tpu.decomp import components as comp_lib
from ppgd_tpu.decomp import losses
from ppgd_tpu.decomp.live_rows import Subset
from ppgd_tpu.step import Decomposer, TrainState
from ppgd_tpu.targets.base import SiteMask, Target


def fast_metrics(dec: Decomposer, state: TrainState, target: Target, batch, labels=None):
    """Device-side fast tier (jit this): (scalars, {site: bool [C] alive components}).

    `labels` (LMs: the next tokens [B, T]) switches on the LM metrics: the recon divergence
    is reported as `eval/kl/<kind>` (it is the KL [S25]), each kind also gets the next-token
    CE `eval/ce/<kind>` of its masked model, `eval/ce/clean` is the frozen model's CE, and a
    `rounded` kind (mask = round(CI lower)) is added. Toys report `eval/recon/<kind>`.
    """
    cfg = dec.cfg
    key = jax.random.fold_in(jax.random.fold_in(dec.run_key(), EVAL_TAG), state.step)
    comps = state.components
    clean = target.clean_output(batch)
    ci = dec.ci(state.ci_fn, comps, target, batch)
    thr = cfg.eval.ci_alive_threshold
    out, alive = {}, {}
    for s in dec.sites:
        active = ci.lower[s] > thr
        alive[s] = jnp.any(active.reshape(-1, active.shape[-1]), axis=0)
        out[f"eval/ci_l0/{s}"] = jnp.mean(jnp.sum(active, axis=-1))
        out[f"eval/alive/{s}"] = jnp.sum(alive[s])

    def recon(masks):
        return dec.recon(target, batch, comps, masks, clean)

    masks = {
        "unmasked": {s: SiteMask(jnp.ones_like(ci.lower[s])) for s in dec.sites},
        "ci_masked": {s: SiteMask(ci.lower[s]) for s in dec.sites},
        "zero": {s: SiteMask(jnp.zeros_like(ci.lower[s])) for s in dec.sites},
        "stochastic": losses.stochastic_masks(jax.random.fold_in(key, 0), ci.lower, dec.sites,
                                              "all", cfg.decomp.use_delta,
                                              Subset.all(batch.shape[0])),
    }
    if labels is not None:
        masks["rounded"] = {s: SiteMask(jnp.round(ci.lower[s])) for s in dec.sites}
    if cfg.eval.pgd_steps > 0:
        src = adv_lib.sign_pgd(jax.random.fold_in(key, 1), "sc", dec.leading, dec.C,
                               cfg.eval.pgd_steps, cfg.eval.pgd_step_size,
                               lambda s: recon(dec.ppgd_masks(ci.lower, s)))
        masks["pgd"] = dec.ppgd_masks(ci.lower, src)
    div = "recon" if labels is None else "kl"
    for kind, m in masks.items():
        masked = target.masked_forward(batch, comps, m)
        out[f"eval/{div}/{kind}"] = target.divergence(masked, clean)
        if labels is not None:
            out[f"eval/ce/{kind}"] = next_token_ce(masked, labels)
    if labels is not None:
        out["eval/ce/clean"] = next_token_ce(clean, labels)
    out["eval/faithfulness"] = comp_lib.faithfulness(comps, target.site_weights())
    return out, alive


def next_token_ce(logits, labels):
    """Mean cross-entropy of `logits` [B, T, V] against the actual next tokens [B, T], fp32."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def one_hot_ci(dec: Decomposer, state: TrainState, target: Target) -> dict:
    """CI lower on the one-hot inputs 0.75 e_i: {site: [n_features, C]} (jit this)."""
    x = 0.75 * jnp.eye(target.n_features)
    return dec.ci(state.ci_fn, state.components, target, x).lower


def identity_ci_error(ci: np.ndarray, tol: float) -> int:
    """After the column permutation maximising the diagonal (Hungarian): off-diagonal
    entries > tol plus diagonal entries < 1 - tol. 0 is perfect."""
    rows, cols = linear_sum_assignment(-ci)
    diag = np.zeros_like(ci, dtype=bool)
    diag[rows, cols] = True
    return int(np.sum(ci[diag] < 1 - tol) + np.sum(ci[~diag] > tol))


def dense_ci_error(ci: np.ndarray, k: int, tol: float) -> int:
    """CI [n_features, C] on the one-hot inputs against k components carrying the site (one
    rank-k mechanism split into k rank-1 parts, e.g. a hidden identity or ResidMLP's W_out:
    SPD paper Fig. 8, 12), as the SPD reference's dense pattern counts it: with the columns
    ordered by CI mass, each of the k densest with no entry >= 1 - tol, plus every entry
    above tol in the others. 0 is perfect. How co-active the k are is the one-hot CI-L0."""
    order = np.argsort(-ci.sum(axis=0), kind="stable")
    dense, rest = ci[:, order[:k]], ci[:, order[k:]]
    return int(np.sum(~np.any(dense >= 1 - tol, axis=0)) + np.sum(rest > tol))


def neuron_alignment(V: np.ndarray, alive: np.ndarray) -> float:
    """Mean over the alive components c of max_n |V[n, c]| / |V[:, c]|, for a site whose
    input units are neurons: 1 when each component reads one neuron (ResidMLP's W_out split
    along its neurons, each component then on only when its neuron fires), ~0.36 for d = 50
    when they read the directions of a random rotation (the same W_out as one rotated rank-d
    block, every component on whenever any neuron fires). 0.0 with nothing alive."""
    if not alive.any():
        return 0.0
    a = np.abs(V[:, alive])
    norm = np.linalg.norm(a, axis=0)  # a zero column reads nothing: 0
    return float(np.mean(np.divide(a.max(axis=0), norm, out=np.zeros_like(norm),
                                   where=norm > 0)))


def mmcs(V: np.ndarray, U: np.ndarray, W: np.ndarray) -> float:
    """Mean over rows f of W of max over c of cos(V[f, c] U[c, :], W[f, :]) (TOYS.md); for a
    site whose features index columns, call it on the transposes."""
    u_n = U / (np.linalg.norm(U, axis=1, keepdims=True) + 1e-12)  # [C, d_out]
    w_n = W / (np.linalg.norm(W, axis=1, keepdims=True) + 1e-12)  # [d_in, d_out]
    cos = np.sign(V) * (w_n @ u_n.T)  # [d_in, C]
    return float(np.mean(np.max(cos, axis=1)))


# For one feature, a component whose part of its row, |V[f, c]| |U[c, :]|, is under this
# share of the largest part cannot be that feature's best (ml2r): its direction is noise
# however well it points. A feature row of W this small (relative to the largest) has no
# scale to rebuild and is left out of the mean.
NEGLIGIBLE = 0.1
DEAD_ROW = 1e-6


def ml2r(V: np.ndarray, U: np.ndarray, W: np.ndarray) -> float:
    """Mean L2 ratio (TOYS.md): mean over rows f of W of |V[f, c]| |U[c, :]| / |W[f, :]|,
    c the row's best component by cosine (as in mmcs) among its non-negligible parts; 1
    when each feature's best component rebuilds it at its own scale, which MMCS cannot see.
    0.0 when no row has a component or W is all zero."""
    u_norm = np.linalg.norm(U, axis=1)
    w_norm = np.linalg.norm(W, axis=1)
    rows = np.flatnonzero(w_norm > DEAD_ROW * w_norm.max()) if w_norm.max() > 0 else []
    ratios = []
    for f in rows:
        part = np.abs(V[f]) * u_norm  # |V[f, c] U[c, :]| per component
        if part.max() == 0:
            ratios.append(0.0)
            continue
        cos = np.sign(V[f]) * (U @ W[f]) / (u_norm * w_norm[f] + 1e-30)
        cos[part < NEGLIGIBLE * part.max()] = -np.inf
        ratios.append(part[np.argmax(cos)] / w_norm[f])
    return float(np.mean(ratios)) if ratios else 0.0


MMCS_RECOVERED = 0.99  # the SPD paper's bar for TMS (Table 1), the foundation issue's too


def identity_recovered(n_alive: int, n_features: int, error: int, mmcs_value) -> bool:
    """An identity-CI site's ground truth (TOYS.md): one alive component per feature, each
    feature's one-hot CI on its own component alone (identity-CI error 0) and, where measured,
    each feature's weights rebuilt by one component (MMCS >= 0.99). No one count suffices:
    merged features can leave n alive with an error, a stray component n + 1 with none."""
    return (n_alive == n_features and error == 0
            and (mmcs_value is None or mmcs_value >= MMCS_RECOVERED))


def host_metrics(dec: Decomposer, state: TrainState, target: Target, onehot: dict | None,
                 alive_masks: dict) -> dict:
    """Scalars computed on the host from fetched arrays (Hungarian, MMCS, alive sums)."""
    out = {}
    weights = {s: np.asarray(w) for s, w in target.site_weights().items()}
    for s in dec.sites:
        V = np.asarray(state.components.V[s])
        U = np.asarray(state.components.U[s])
        alive = alive_masks[s]
        approx = (V[:, alive] @ U[alive]) if alive.any() else np.zeros_like(weights[s])
        out[f"eval/alive_sum_rel_error/{s}"] = float(
            np.linalg.norm(approx - weights[s]) / (np.linalg.norm(weights[s]) + 1e-12))
        ci = None if onehot is None else np.asarray(onehot[s])
        if ci is not None:
            out[f"eval/onehot_ci_l0/{s}"] = float(np.mean(np.sum(
                ci > dec.cfg.eval.ci_alive_threshold, axis=-1)))
        if ci is not None and s in target.identity_ci_sites:
            err = identity_ci_error(ci, dec.cfg.eval.identity_tol)
            out[f"eval/identity_ci_error/{s}"] = err
            W = weights[s]
            if W.shape[0] == target.n_features:  # features index rows (e.g. TMS linear1)
                out[f"eval/mmcs/{s}"] = mmcs(V, U, W)
                out[f"eval/ml2r/{s}"] = ml2r(V, U, W)
            elif W.shape[1] == target.n_features:  # features index columns (TMS linear2)
                out[f"eval/mmcs/{s}"] = mmcs(U.T, V.T, W.T)
                out[f"eval/ml2r/{s}"] = ml2r(U.T, V.T, W.T)
            out[f"eval/recovered/{s}"] = int(identity_recovered(
                int(alive.sum()), target.n_features, err, out.get(f"eval/mmcs/{s}")))
        if s in target.neuron_input_sites:
            out[f"eval/neuron_alignment/{s}"] = neuron_alignment(V, alive)
        if ci is not None and s in target.dense_ci_sites:
            err = dense_ci_error(ci, target.dense_ci_sites[s], dec.cfg.eval.identity_tol)
            out[f"eval/dense_ci_error/{s}"] = err
            out[f"eval/recovered/{s}"] = int(err == 0)
    return out


def recovery_note(summary: dict) -> str | None:
    """The console line for sites whose ground truth was missed (None when all were met)."""
    missed = [k.removeprefix("eval/recovered/") for k, v in summary.items()
              if k.startswith("eval/recovered/") and not v]
    if not missed:
        return None
    return (f"ground truth NOT recovered on {', '.join(missed)}: README, 'Decompose a toy', "
            "says what each toy config recovers and what to try when it does not.")


# ---------------------------------------------------------------- slow tier (figures)


def figures(dec: Decomposer, state: TrainState, target: Target, batch, out_dir: str,
            title: str = "") -> list[str]:
    """CI per input feature (heatmaps), component norms and weights, CI histograms and
    activation densities -> PNG files, each titled `title` (the run and step). The norm,
    weight and density figures order a site's components the same way, by norm
    |V_c| |U_c|, and (up to 40 of them) name each by its index c, as in the checkpoint, so
    one can be followed across them; the CI heatmap puts each feature's best one first.
    Runs in one process, on host arrays (engine._evaluate fetches them in every process)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    # jitted: op by op, the CI fn compiles and dispatches hundreds of tiny programs (~3 s)
    lower = jax.jit(lambda st, t, x: dec.ci(st.ci_fn, st.components, t, x).lower)
    ci = {s: np.asarray(x) for s, x in lower(state, target, batch).items()}
    n = len(dec.sites)

    def panels(what: str, rows: int = 1):
        fig, axes = plt.subplots(rows, n, figsize=(4.5 * n, 3.8 * rows), squeeze=False,
                                 layout="constrained")
        fig.suptitle(f"{title}\n{what}" if title else what, fontsize=10)
        return fig, (axes[0] if rows == 1 else axes)

    U = {s: np.asarray(state.components.U[s]) for s in dec.sites}
    norms = {s: np.linalg.norm(np.asarray(state.components.V[s]), axis=0)
             * np.linalg.norm(U[s], axis=1) for s in dec.sites}  # |V_c| |U_c|
    order = {s: np.argsort(norms[s], kind="stable")[::-1] for s in dec.sites}

    def by_norm(ax, s: str) -> None:
        if len(order[s]) <= 40:  # readable ticks: each bar's c
            ax.set_xlabel("component c, by norm")
            ax.set_xticks(np.arange(len(order[s])), [str(c) for c in order[s]], fontsize=6,
                          rotation=90)
        else:
            ax.set_xlabel("rank of the component by norm")

    if target.n_features is not None:
        onehot = jax.device_get(jax.jit(lambda st, t: one_hot_ci(dec, st, t))(state, target))
        fig, axes = panels("CI on each one-hot input 0.75 e_i")
        for ax, s in zip(axes, dec.sites):
            m = np.asarray(onehot[s])
            rows, cols = linear_sum_assignment(-m)
            matched = list(cols) + [c for c in range(m.shape[1]) if c not in set(cols)]
            im = ax.imshow(m[:, matched], vmin=0, vmax=1, cmap="Blues", aspect="auto")
            ax.set_title(s, fontsize=9)
            ax.set_ylabel("input feature i")
            if len(matched) <= 40:
                ax.set_xlabel("component c (each feature's best first)")
                ax.set_xticks(np.arange(len(matched)), [str(c) for c in matched], fontsize=6,
                              rotation=90)
            else:
                ax.set_xlabel("components, each feature's best first")
        fig.colorbar(im, ax=axes.tolist(), label="CI")
        written.append(_save(fig, out_dir, "ci_per_feature.png"))

    fig, axes = panels("component norms |V_c| |U_c|")
    for ax, s in zip(axes, dec.sites):
        ax.bar(np.arange(len(order[s])), norms[s][order[s]])
        ax.set_title(s, fontsize=9)
        ax.set_yscale("log")
        ax.set_ylabel("|V_c| |U_c|")
        by_norm(ax, s)
    written.append(_save(fig, out_dir, "component_norms.png"))

    # both sides: a toy's features sit on V's side of one site and U's of the next, and the
    # narrow side of a ResidMLP site (d_mlp) is the readable one
    fig, axes = panels("the 12 largest components: V[:, c] (what c reads) and U[c, :] (what "
                       "it writes)", rows=2)
    for col, s in enumerate(dec.sites):
        keep = order[s][: min(len(order[s]), 12)]
        sides = (("V[:, c]", "input dim (d_in", np.asarray(state.components.V[s]).T[keep]),
                 ("U[c, :]", "output dim (d_out", U[s][keep]))
        for ax, (name, dim, w) in zip(axes[:, col], sides):
            top = float(np.abs(w).max()) or 1.0
            im = ax.imshow(w, cmap="RdBu", aspect="auto", vmin=-top, vmax=top,
                           interpolation="nearest")
            ax.set_title(f"{s}: {name}", fontsize=9)
            ax.set_yticks(np.arange(len(keep)), [str(c) for c in keep], fontsize=7)
            ax.set_ylabel("component c, by norm")
            ax.set_xlabel(f"{dim} {w.shape[1]})")
            if w.shape[1] <= 40:
                ax.set_xticks(np.arange(w.shape[1]))
            fig.colorbar(im, ax=ax, label=name)
    written.append(_save(fig, out_dir, "component_weights.png"))

    fig, axes = panels("CI values (lower) over the eval batch")
    for ax, s in zip(axes, dec.sites):
        ax.hist(np.asarray(ci[s]).ravel(), bins=50, range=(0, 1))
        ax.set_yscale("log")
        ax.set_title(s, fontsize=9)
        ax.set_xlabel("CI")
        ax.set_ylabel("count (positions x components)")
    written.append(_save(fig, out_dir, "ci_histograms.png"))

    thr = dec.cfg.eval.ci_alive_threshold
    fig, axes = panels(f"activation density: the fraction of positions "
                                             f"with CI > {thr}")
    for ax, s in zip(axes, dec.sites):
        density = activation_density(np.asarray(ci[s]), thr)
        ax.bar(np.arange(len(density)), density[order[s]], width=0.9)
        ax.set_ylim(0, max(float(density.max()) * 1.1, 1e-3))  # linear: a 0 stays visible
        ax.set_title(s, fontsize=9)
        ax.set_ylabel("fraction of positions")
        by_norm(ax, s)
    written.append(_save(fig, out_dir, "activation_density.png"))
    return written


def activation_density(ci: np.ndarray, threshold: float) -> np.ndarray:
    """Per component: the fraction of positions (every leading index) with CI > threshold."""
    return np.mean(ci.reshape(-1, ci.shape[-1]) > threshold, axis=0)


def _save(fig, out_dir, name):
    import io

    import matplotlib.pyplot as plt

    path = storage.join(out_dir, name)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    storage.write_bytes(path, buf.getvalue())  # local dir or gs://
    return path
