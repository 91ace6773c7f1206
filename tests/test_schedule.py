"""Batch schedule: batch j is a pure function of (seed, j) [C1, W1] (which rows each
process reads of it: tests/test_lm_data_multiprocess.py [D1, D3])."""

import tracemalloc

import numpy as np
import pytest

from ppgd_tpu.data.schedule import BatchSchedule, permute, train_eval_schedules


@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 1000, 4097])
def test_permute_is_a_bijection(n):
    for key in (0, 1, 2**63 + 5):
        image = permute(np.arange(n), n, key)
        np.testing.assert_array_equal(np.sort(image), np.arange(n))


def test_schedule_is_a_pure_function_of_seed_and_batch_C1():
    a, b = BatchSchedule(1000, 32, seed=7), BatchSchedule(1000, 32, seed=7)
    for j in (0, 1, 30, 31, 12345):
        np.testing.assert_array_equal(a.rows(j), b.rows(j))
    # any order of asking gives the same answer (no iterator state)
    np.testing.assert_array_equal(a.rows(5), [a.rows(j) for j in (9, 5, 0)][1])
    assert not np.array_equal(a.rows(0), BatchSchedule(1000, 32, seed=8).rows(0))
    assert not np.array_equal(a.rows(0), a.rows(1))


def test_each_epoch_is_a_fresh_permutation():
    s = BatchSchedule(960, 64, seed=3)  # 15 batches per epoch, no remainder
    epochs = [np.concatenate([s.rows(e * 15 + b) for b in range(15)]) for e in range(3)]
    for order in epochs:  # every row exactly once per epoch
        np.testing.assert_array_equal(np.sort(order), np.arange(960))
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[1], epochs[2])
    # a shuffle, not a rotation of the identity: few rows keep their position
    assert np.mean(epochs[0] == np.arange(960)) < 0.05


def test_epoch_remainder_is_dropped_and_varies():
    s = BatchSchedule(1000, 64, seed=3)  # 15 batches = 960 rows per epoch, 40 skipped
    assert s.batches_per_epoch == 15 and s.epoch(14) == 0 and s.epoch(15) == 1
    seen = [np.concatenate([s.rows(e * 15 + b) for b in range(15)]) for e in range(2)]
    for order in seen:
        assert len(np.unique(order)) == 960 and order.min() >= 0 and order.max() < 1000
    assert set(seen[0]) != set(seen[1])  # a different 40 rows rest each epoch


def test_a_store_smaller_than_one_batch_is_refused():
    with pytest.raises(ValueError, match="10 rows, fewer than one global batch of 16"):
        BatchSchedule(10, 16, seed=0)


def test_addressing_is_O_batch_not_O_rows():
    n_rows, batch = 10**7, 256
    s = BatchSchedule(n_rows, batch, seed=5)
    tracemalloc.start()
    rows = s.rows(10**9)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 200_000 < n_rows  # a per-row table would need >= n_rows bytes
    assert s.epoch(10**9) == 10**9 // (n_rows // batch)
    assert len(np.unique(rows)) == batch and rows.min() >= 0 and rows.max() < n_rows
    huge = BatchSchedule(2**62, 8, seed=1).rows(2**61)  # would not fit any memory if O(n)
    assert len(np.unique(huge)) == 8 and huge.max() < 2**62


def test_eval_stream_has_its_own_seed_batch_and_rows():
    train, ev = train_eval_schedules(1000, train_batch=32, train_seed=0, eval_batch=10,
                                     eval_seed=1, eval_rows=100)
    assert len(ev.rows(0)) == 10 and len(train.rows(0)) == 32
    train_rows = np.concatenate([train.rows(j) for j in range(train.batches_per_epoch)])
    eval_rows = np.concatenate([ev.rows(j) for j in range(ev.batches_per_epoch)])
    np.testing.assert_array_equal(np.sort(eval_rows), np.arange(100))
    assert len(np.unique(train_rows)) == 896 == len(train_rows)  # 900 rows, 4 rest
    assert train_rows.min() >= 100 and train_rows.max() < 1000  # disjoint from eval
    shared_train, shared_eval = train_eval_schedules(1000, train_batch=32, train_seed=0,
                                                     eval_batch=32, eval_seed=1)
    assert not np.array_equal(shared_train.rows(0), shared_eval.rows(0))
