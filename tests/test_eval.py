"""The one-hot CI pattern metrics (TOYS.md "Metrics"), against hand-built CI matrices whose
error is counted by hand."""

import numpy as np

from ppgd_tpu import eval as eval_lib

TOL = 0.1


def test_identity_ci_error_counts_after_the_best_permutation():
    ci = np.zeros((4, 6))
    ci[[0, 1, 2, 3], [5, 0, 3, 1]] = 1.0  # the identity, columns shuffled, 2 spare columns
    assert eval_lib.identity_ci_error(ci, TOL) == 0
    ci[2, 3] = 0.85  # a weak diagonal entry
    ci[0, 2] = 0.3  # a second component on for feature 0
    assert eval_lib.identity_ci_error(ci, TOL) == 2


def test_identity_recovered_needs_every_count():
    """TOYS.md's ground truth: n alive, identity-CI error 0 and MMCS >= 0.99 together."""
    assert eval_lib.identity_recovered(5, 5, 0, 0.9999)
    assert eval_lib.identity_recovered(100, 100, 0, None)  # MMCS not measured on the site
    assert not eval_lib.identity_recovered(5, 5, 6, 0.99)  # merged features, 5 alive
    assert not eval_lib.identity_recovered(6, 5, 0, 1.0)  # a stray alive component
    assert not eval_lib.identity_recovered(4, 5, 0, 1.0)
    assert not eval_lib.identity_recovered(5, 5, 0, 0.985)  # the right pattern, blurred weights
    assert eval_lib.identity_recovered(5, 5, 0, 0.99)


def test_recovery_note_names_the_missed_sites():
    summary = {"eval/recovered/linear1": 1, "eval/recovered/linear2": 0,
               "eval/recovered/hidden_layers.0": 0, "eval/alive/linear2": 0}
    note = eval_lib.recovery_note(summary)
    assert "NOT recovered on linear2, hidden_layers.0:" in note
    assert eval_lib.recovery_note({"eval/recovered/linear1": 1, "eval/alive/x": 0}) is None


def test_dense_ci_error_counts_missing_and_extra_components():
    rng = np.random.default_rng(0)
    n, C, k = 10, 12, 4
    ci = rng.uniform(0.0, 0.05, (n, C))
    dense = [7, 1, 10, 3]
    ci[:, dense] = rng.uniform(0.95, 1.0, (n, k))
    assert eval_lib.dense_ci_error(ci, k, TOL) == 0
    assert eval_lib.dense_ci_error(ci, k - 1, TOL) == n  # one always-on column too many
    assert eval_lib.dense_ci_error(ci, k + 1, TOL) == 1  # a dense column missing

    # The k need not all be on for every input (a hidden identity: a feature along one
    # component's direction needs only that one), but each must be fully on somewhere.
    partial = ci.copy()
    partial[: n // 2, 7] = 0.0
    assert eval_lib.dense_ci_error(partial, k, TOL) == 0
    partial[:, 1] = 0.5  # on for every feature but never fully: counts once
    assert eval_lib.dense_ci_error(partial, k, TOL) == 1
    partial[:3, 0] = 0.2  # a fifth component weakly on for 3 features
    assert eval_lib.dense_ci_error(partial, k, TOL) == 1 + 3


def test_neuron_alignment_is_one_for_components_reading_one_neuron_each():
    d = 50
    V = np.zeros((d, 60))
    V[np.arange(d), np.arange(d)] = np.linspace(0.5, 2.0, d)  # one neuron each, any scale
    V[:, d:] = 1.0  # ten dead components reading everything
    alive = np.arange(60) < d
    assert eval_lib.neuron_alignment(V, alive) == 1.0
    R = np.linalg.qr(np.random.default_rng(0).normal(size=(d, d)))[0]
    rotated = eval_lib.neuron_alignment(V[:, :d] @ R, alive[:d])  # the same span, rotated
    assert 0.25 < rotated < 0.6
    two = np.array([[3.0, 0.0], [4.0, 1.0]])  # |V| 5 with max 4; one neuron: 1
    assert np.isclose(eval_lib.neuron_alignment(two, np.array([True, True])), (0.8 + 1.0) / 2)
    assert eval_lib.neuron_alignment(two, np.array([False, False])) == 0.0


def test_ml2r_is_the_best_components_norm_over_the_features_and_ignores_negligible_ones():
    """TOYS.md's mean L2 ratio on hand-built components: feature rows of W rebuilt by one
    component each at a known scale. A part of a row too small to matter is not that
    feature's best however well it points: a tiny component exactly along feature 0, and a
    component large for feature 1 whose share of feature 0 is tiny."""
    W = np.array([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0]])  # 2 features, d_out 3
    V = np.array([[1.5, 0.0, 1e-6], [0.0, -4.0, 0.0]])  # [2, C=3]
    U = np.array([[0.96, 0.28, 0.0],   # feature 0, slightly off its direction: |U| 1
                  [0.0, -1.0, 0.0],    # feature 1 with a sign flip in V: rebuilt at 2x
                  [1.0, 0.0, 0.0]])    # tiny (1e-6), exactly along feature 0
    # feature 0: |1.5| * 1 / 3 = 0.5; feature 1: |-4| * 1 / 2 = 2
    assert np.isclose(eval_lib.ml2r(V, U, W), (0.5 + 2.0) / 2)
    assert np.isclose(eval_lib.mmcs(V, U, W), 1.0)  # the tiny one wins MMCS's argmax
    # a 4th component, large (5) for feature 1, points exactly along feature 0 and reads
    # it a little (0.01): it wins feature 0's cosine, but is not its best
    V2 = np.hstack([V, [[0.01], [5.0]]])
    U2 = np.vstack([U, [1.0, 0.0, 0.0]])
    assert np.isclose(eval_lib.ml2r(V2, U2, W), (0.5 + 2.0) / 2)
    assert np.isclose(eval_lib.ml2r(V[:, 2:], U[2:], W), 1e-6 / 3 / 2)  # alone, it counts
    assert eval_lib.ml2r(np.zeros((2, 3)), U, W) == 0.0
    # a dead feature row (no scale to rebuild) is left out, not divided by ~0
    W3 = np.array([[3.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 1e-9]])
    V3 = np.vstack([V, [0.0, 0.0, 1e-3]])
    assert np.isclose(eval_lib.ml2r(V3, U, W3), (0.5 + 2.0) / 2)
