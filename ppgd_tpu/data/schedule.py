"""Batch schedule: which store rows make up data batch j, as a pure function of (seed, j).

Training step s reads data batch j = s // k [W1]; because the rows of batch j depend on
nothing but (seed, j), a resumed run needs no iterator state and the checkpoint stores no
data position [C1]. Every process computes the same global batch and reads only the rows
its own devices hold (`mesh.global_batch`), so the rows that meet in a step are the same on
any number of processes [D3].

Epochs: an epoch is `batches_per_epoch = n_rows // global_batch` batches; the remaining
`n_rows % global_batch` rows of each epoch's permutation are skipped (a different set each
epoch), so batch j lies entirely in epoch j // batches_per_epoch. Each epoch visits the
rows in the order of a keyed bijection on [0, n_rows): a balanced Feistel network over the
next even power of two, keyed by (seed, epoch), with cycle walking back into range. Any
batch costs O(global_batch) work and memory, never O(n_rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_MASK64 = (1 << 64) - 1
_ROUNDS = 6


def _mix64(x: int) -> int:
    """splitmix64 finalizer on a Python int: derives independent round keys."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _round_fn(r: np.ndarray, key: np.uint64) -> np.ndarray:
    """Feistel round function: the same finalizer, vectorized over uint64 (wrapping)."""
    x = r ^ key
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def permute(positions: np.ndarray, n: int, key: int) -> np.ndarray:
    """Images of `positions` (in [0, n)) under the keyed bijection of [0, n) named `key`."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)  # domain 2**(2*half) >= n, < 4n
    mask = np.uint64((1 << half) - 1)
    shift = np.uint64(half)
    keys = [np.uint64(_mix64(key ^ _mix64(i))) for i in range(_ROUNDS)]

    def feistel(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for k in keys:
            left, right = right, left ^ (_round_fn(right, k) & mask)
        return (left << shift) | right

    x = feistel(np.asarray(positions, dtype=np.uint64))
    out = x >= np.uint64(n)
    while out.any():  # cycle walking: stays a bijection on [0, n), expected < 4 passes
        x[out] = feistel(x[out])
        out = x >= np.uint64(n)
    return x.astype(np.int64)


@dataclass(frozen=True)
class BatchSchedule:
    """Rows `[first_row, first_row + n_rows)` of a store, served as shuffled global batches.

    `rows(j)` is the global batch j (row ids into the store); each process reads the rows
    of its own devices' shards of it (`mesh.global_batch`).
    """

    n_rows: int
    global_batch: int
    seed: int
    first_row: int = 0

    def __post_init__(self):
        if self.global_batch < 1:
            raise ValueError(f"global batch must be >= 1, got {self.global_batch}")
        if self.n_rows < self.global_batch:
            raise ValueError(
                f"the token store has {self.n_rows} rows, fewer than one global batch of "
                f"{self.global_batch}: lower the batch size or tokenize more data")
        if self.first_row < 0:
            raise ValueError(f"first_row must be >= 0, got {self.first_row}")

    @property
    def batches_per_epoch(self) -> int:
        return self.n_rows // self.global_batch

    def epoch(self, j: int) -> int:
        return j // self.batches_per_epoch

    def _key(self, epoch: int) -> int:
        return _mix64(_mix64(self.seed & _MASK64) ^ (epoch & _MASK64))

    def rows(self, j: int) -> np.ndarray:
        """Store row ids of global batch j, `int64[global_batch]`."""
        if j < 0:
            raise ValueError(f"batch index must be >= 0, got {j}")
        epoch, b = divmod(j, self.batches_per_epoch)
        start = b * self.global_batch
        positions = np.arange(start, start + self.global_batch, dtype=np.uint64)
        return self.first_row + permute(positions, self.n_rows, self._key(epoch))


def train_eval_schedules(n_rows: int, *, train_batch: int, train_seed: int,
                         eval_batch: int, eval_seed: int, eval_rows: int = 0
                         ) -> tuple[BatchSchedule, BatchSchedule]:
    """The training stream and a separate eval stream with its own seed and batch size.

    `eval_rows > 0` holds out the first `eval_rows` rows of the store for eval (training
    uses the rest); `eval_rows == 0` lets eval draw from all rows in its own order.
    """
    if not 0 <= eval_rows < n_rows:
        raise ValueError(f"eval_rows must lie in [0, {n_rows}) (the store's rows), "
                         f"got {eval_rows}")
    if eval_rows:
        return (BatchSchedule(n_rows - eval_rows, train_batch, train_seed, first_row=eval_rows),
                BatchSchedule(eval_rows, eval_batch, eval_seed))
    return (BatchSchedule(n_rows, train_batch, train_seed),
            BatchSchedule(n_rows, eval_batch, eval_seed))
