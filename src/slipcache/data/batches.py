"""`Batch` and `BatchIterator`: a split cut into training or evaluation batches, whole or one rank's part.

The iterator decides a batch's rows by their positions in the split first (the epoch's order, the sample
filter) and reads the rows only then, so a rank of N reads just its slice of every global batch
(`part=(rank, N)`): its dense and sparse rows, plus the global batch's labels (4 bytes per sample) that
the loss and every metric are computed over on every rank. The batches are those of the whole-batch
iterator, sliced.
"""

from __future__ import annotations

import math
import typing
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from slipcache.data.dataset import SplitArrays, check_labels
from slipcache.errors import SlipcacheError

# filter(sparse) -> keep mask; one whose `wants_positions` is True is called filter(sparse, split positions)
SampleFilter = Callable[..., np.ndarray]


def slice_bounds(batch: int, world_size: int, rank: int) -> tuple[int, int]:
    """This rank's [start, end) of a global batch: sizes differ by at most one, larger ones first."""
    base, extra = divmod(batch, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass
class Batch:
    """dense float32 [b, 13], sparse int64 [b, 26], labels float32 [B].

    `rows` is None for a whole batch (b = B); for one rank's part it is the [start, end) of the global
    batch that dense and sparse hold, while labels stay the global batch's.
    """

    dense: torch.Tensor
    sparse: torch.Tensor
    labels: torch.Tensor
    rows: tuple[int, int] | None = None

    def __len__(self) -> int:
        """Samples in the (global) batch."""
        return int(self.labels.shape[0])

    def logits(self, model: Callable[..., torch.Tensor]) -> torch.Tensor:
        """`model`'s logits of the global batch; a rank's part goes with the global batch size
        (`distributed.model.ShardedDLRM.forward`), a whole batch as (dense, sparse) alone."""
        if self.rows is None:
            return model(self.dense, self.sparse)
        return model(self.dense, self.sparse, batch_size=len(self))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(
            self.dense.to(device, non_blocking=non_blocking),
            self.sparse.to(device, non_blocking=non_blocking),
            self.labels.to(device, non_blocking=non_blocking),
            self.rows,
        )


class BatchIterator:
    """One epoch of batches over a split, `chunk_batches` batches of positions at a time.

    Order: with `shuffle`, chunks (contiguous sample ranges) are visited in a permuted order and samples
    are permuted within each chunk, both derived from (seed, epoch), so an epoch is reproducible. With
    `in_order` too, chunks keep their order and only samples within a chunk are permuted: time-ordered
    data (synthetic v3, Criteo days) is then trained earlier days first, shuffled within windows.
    `sample_filter(sparse int32 [n, 26]) -> bool [n]` drops samples before batches are cut, so every
    batch but the last is full; it is called on batch-sized pieces only when a batch is assembled (on
    `next`, `peek` or `lookahead`), so a stateful filter sees the state of the batches consumed so far.
    `start_batch` resumes mid-epoch: the batches that follow are exactly those an uninterrupted iterator
    would yield (without a filter it jumps there directly; with one it re-runs the filter over the skipped
    batches, so the filter must decide the same way again). `peek(k)` returns the next k batches without
    consuming them; `lookahead` keeps that many assembled ahead after each step. `stop` reads only the
    split's first `stop` rows. `part=(rank, world_size)` reads only that rank's slice of every batch
    (`slice_bounds`; see the module doc); a sample filter still reads the ids of every row it decides on.
    `groups` (one small integer per row of the split) makes the epoch visit the rows of the lowest group
    first, then the next, each group in the epoch's order (FAE's cold inputs before the hot ones); batches
    are cut from that sequence, so one batch may span two groups.

    Counters: `samples_seen` counts samples in yielded batches, `samples_dropped` those the filter
    removed before them (the filter's drops after the last batch are added when the epoch ends);
    `batch_index` is the index of the next batch, usable as a later `start_batch`; `bytes_read` the bytes
    of rows taken from the split.
    """

    def __init__(
        self,
        split: SplitArrays,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        epoch: int = 0,
        drop_last: bool = False,
        lookahead: int = 0,
        sample_filter: SampleFilter | None = None,
        start_batch: int = 0,
        chunk_batches: int = 64,
        in_order: bool = False,
        stop: int | None = None,
        part: tuple[int, int] | None = None,
        groups: np.ndarray | None = None,
    ) -> None:
        if batch_size < 1:
            raise SlipcacheError(f"batch size must be at least 1, got {batch_size}")
        if lookahead < 0 or start_batch < 0 or chunk_batches < 1:
            raise SlipcacheError("lookahead and start_batch must be >= 0 and chunk_batches >= 1")
        if part is not None and not 0 <= part[0] < part[1]:
            raise SlipcacheError(f"part must be (rank, world size) with 0 <= rank < world size, got {part}")
        self.split = split
        self._source = getattr(split, "source", "labels")  # named in a bad label's error
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = epoch
        self.drop_last = drop_last
        self.lookahead = lookahead
        self.sample_filter = sample_filter
        self.part = part
        self.chunk_size = batch_size * chunk_batches
        self.rows = len(split) if stop is None else max(0, min(len(split), stop))
        starts = np.arange(0, self.rows, self.chunk_size, dtype=np.int64)
        self._chunks = [(int(s), min(int(s) + self.chunk_size, self.rows)) for s in starts]
        if groups is not None and np.shape(groups) != (len(split),):
            raise SlipcacheError(
                f"groups must hold one value per row of the split ({len(split)}), got {np.shape(groups)}"
            )
        self.groups = groups
        passes = [None] if groups is None else [int(g) for g in np.flatnonzero(np.bincount(groups[: self.rows]))]
        if shuffle and not in_order:
            order = np.random.default_rng([seed, epoch]).permutation(len(self._chunks))
            self._order = [int(i) for i in order]
        else:
            self._order = list(range(len(self._chunks)))
        self._visits = [(group, chunk) for group in passes for chunk in self._order]  # (group, chunk) in order
        self.samples_seen = 0
        self.samples_dropped = 0
        self.batch_index = 0
        self.bytes_read = 0
        self._tail_dropped = 0
        self._exhausted = False
        self._buffer: deque[tuple[Batch, int]] = deque()
        self._gen = self._generate(start_batch)
        self._fill(lookahead)

    def __len__(self) -> int:
        """Batches in the whole epoch (not the remaining ones); unknown with a sample filter."""
        if self.sample_filter is not None:
            raise TypeError("the number of batches is unknown when a sample_filter is set")
        n = self.rows
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if not self._buffer:
            self._fill(1)
        if not self._buffer:
            if not self._exhausted:
                self._exhausted = True
                self.samples_dropped += self._tail_dropped
            raise StopIteration
        batch, dropped = self._buffer.popleft()
        self.samples_seen += len(batch)
        self.samples_dropped += dropped
        self.batch_index += 1
        self._fill(self.lookahead)
        return batch

    def peek(self, k: int) -> list[Batch]:
        """The next k batches (fewer at the end of the epoch), without consuming them."""
        self._fill(k)
        return [batch for batch, _ in list(self._buffer)[:k]]

    def _fill(self, k: int) -> None:
        while len(self._buffer) < k:
            item = next(self._gen, None)
            if item is None:
                return
            self._buffer.append(item)

    # ------------------------------------------------------------------------------------- reading
    def _positions(self, visit: tuple[int | None, int]) -> np.ndarray:
        """The split positions of one visit (a group's rows of a chunk), in the epoch's order."""
        group, chunk = visit
        start, end = self._chunks[chunk]
        positions = np.arange(start, end, dtype=np.int64)
        if self.shuffle:
            positions = positions[np.random.default_rng([self.seed, self.epoch, chunk]).permutation(end - start)]
        if group is not None:
            positions = positions[self.groups[positions] == group]  # type: ignore[index]
        return positions

    def _visit_size(self, visit: tuple[int | None, int]) -> int:
        group, chunk = visit
        start, end = self._chunks[chunk]
        return end - start if group is None else int(np.count_nonzero(self.groups[start:end] == group))  # type: ignore[index]

    def _take(self, column: typing.Any, positions: np.ndarray) -> np.ndarray:
        """Rows of a column at `positions`, in their order. Positions that fill a contiguous range (a whole
        chunk, an unshuffled batch) are read as one slice, copied and reordered in memory; others (a rank's
        rows, scattered by the shuffle) are read in file order, which is several times faster than in
        shuffled order, and put back in theirs."""
        if not len(positions):
            rows = np.asarray(column[0:0])
        else:
            low, high = int(positions.min()), int(positions.max()) + 1
            if high - low == len(positions):  # positions are distinct: they fill [low, high)
                block = np.asarray(column[low:high])
                block = block if block.flags.owndata else np.array(block)  # a file's pages: copy them at once
                in_order = bool((np.diff(positions) == 1).all())
                rows = block if in_order else block[positions - low]
            else:  # sorted through a mask over [low, high): linear, unlike a sort
                wanted = np.zeros(high - low, dtype=bool)
                wanted[positions - low] = True
                read = np.asarray(column[low + np.flatnonzero(wanted)])
                rows = read[(np.cumsum(wanted) - 1)[positions - low]]
        self.bytes_read += rows.nbytes
        return rows

    def _read(self, batches: list[np.ndarray], ids: list[np.ndarray | None]) -> list[Batch]:
        """The batches of these positions (this rank's part of each with `part`), read together: one read
        per column for all of them. `ids`: each batch's ids when the sample filter read them already."""
        bounds = [
            (0, len(p)) if self.part is None else slice_bounds(len(p), self.part[1], self.part[0]) for p in batches
        ]
        mine = [p[start:end] for p, (start, end) in zip(batches, bounds, strict=True)]
        cuts = np.cumsum([0] + [len(p) for p in batches])
        mine_cuts = np.cumsum([0] + [len(p) for p in mine])
        labels = check_labels(self._take(self.split.labels, np.concatenate(batches)), self._source)
        dense = self._take(self.split.dense, np.concatenate(mine))
        known = all(i is not None for i in ids)
        sparse = None if known else self._take(self.split.sparse, np.concatenate(mine))
        result = []
        for k, (start, end) in enumerate(bounds):
            a, b = int(mine_cuts[k]), int(mine_cuts[k + 1])
            rows = ids[k][start:end] if known else sparse[a:b]  # type: ignore[index]
            result.append(
                Batch(
                    dense=torch.from_numpy(np.ascontiguousarray(dense[a:b])),
                    sparse=torch.from_numpy(rows.astype(np.int64)),
                    labels=torch.from_numpy(np.ascontiguousarray(labels[int(cuts[k]) : int(cuts[k + 1])])),
                    rows=None if self.part is None else (start, end),
                )
            )
        return result

    def _keep(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The positions the sample filter keeps, and their ids (read for the filter)."""
        sparse = self._take(self.split.sparse, positions)
        assert self.sample_filter is not None
        # A filter that keeps per-input state (loss pruning) also gets the split positions.
        wants = getattr(self.sample_filter, "wants_positions", False)
        mask = self.sample_filter(sparse, positions) if wants else self.sample_filter(sparse)
        mask = np.asarray(mask, dtype=bool)
        if mask.shape != positions.shape:
            raise SlipcacheError(f"sample_filter returned shape {mask.shape}, expected {positions.shape}")
        return positions[mask], sparse[mask]

    def _generate(self, start_batch: int) -> Iterator[tuple[Batch, int]]:
        """Yield (batch, samples dropped by the filter since the previous batch)."""
        first_chunk, offset = 0, 0
        skip = start_batch
        if self.sample_filter is None and start_batch > 0:
            # Without a filter batch i is samples [i*B, (i+1)*B) of the epoch's order: jump straight there.
            sizes = np.array([self._visit_size(v) for v in self._visits], dtype=np.int64)
            position = min(start_batch * self.batch_size, int(sizes.sum()))
            ends = np.cumsum(sizes)
            first_chunk = int(np.searchsorted(ends, position, side="right"))
            offset = position - int(ends[first_chunk - 1] if first_chunk > 0 else 0)
            self.samples_seen = position
            self.batch_index = start_batch
            skip = 0
        B = self.batch_size
        carry: np.ndarray | None = None  # positions of the rows that fill no batch yet
        carry_ids: np.ndarray | None = None  # their ids, when the filter read them
        dropped = 0
        for visit in self._visits[first_chunk:]:
            positions = self._positions(visit)[offset:]
            offset = 0
            # Filter a batch-sized piece at a time, as late as possible: a stateful filter (stale-input
            # skipping) then decides with its state as of the batches consumed so far.
            pieces = (
                [positions] if self.sample_filter is None
                else [positions[i : i + B] for i in range(0, len(positions), B)]
            )
            for piece in pieces:
                ids = None
                if self.sample_filter is not None:
                    kept, ids = self._keep(piece)
                    dropped += len(piece) - len(kept)
                    piece = kept
                if carry is not None:
                    piece = np.concatenate([carry, piece])
                    ids = None if ids is None else np.concatenate([carry_ids, ids])
                full = len(piece) // B
                skipped = min(skip, full)
                if skipped:  # resumed with a filter: batches before start_batch are cut, not read
                    skip -= skipped
                    self.samples_seen += skipped * B
                    self.samples_dropped += dropped
                    self.batch_index += skipped
                    dropped = 0
                cut = [slice(i * B, (i + 1) * B) for i in range(skipped, full)]
                if cut:
                    batches = self._read([piece[c] for c in cut], [None if ids is None else ids[c] for c in cut])
                    for batch in batches:
                        yield batch, dropped
                        dropped = 0
                carry = piece[full * B :]
                carry_ids = None if ids is None else ids[full * B :]
        if carry is not None and len(carry) and not self.drop_last:
            if skip:
                self.samples_seen += len(carry)
                self.samples_dropped += dropped
                self.batch_index += 1
            else:
                yield self._read([carry], [carry_ids])[0], dropped
            dropped = 0
        self._tail_dropped = dropped
