"""The data of `labs train` in the shape HF's Trainer and accelerate expect: a map-style Dataset of packed rows and
a Sampler whose order, once `accelerate` deals it to the ranks, gives every rank exactly the micro-batches that
`labs.data.rank_batches` gives it, in the same order. Then a Trainer or an accelerate loop sees the same tokens as
a `labs train` run with the same seed, and their losses can be compared step by step.

How the dealing works: `accelerator.prepare(DataLoader(...))` (the Trainer calls it too) cuts the sampler's index
stream into batches of `micro_batch` and gives batch j to rank j % world_size (accelerate's `BatchSamplerShard`).
So the sampler lists rank 0's first micro-batch, then rank 1's first, ..., then rank 0's second, and so on.
"""
from __future__ import annotations

import torch
from torch.utils.data import Dataset, Sampler

from labs.errors import LabsError


class TokenRows(Dataset):
    """Packed token rows [n, seq_len] as causal-LM examples: the labels are the inputs (the model shifts them)."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, index):
        return {"input_ids": self.rows[index], "labels": self.rows[index]}


class LabsOrder(Sampler):
    """Row indices in the order that makes accelerate's round-robin dealing reproduce `labs.data.rank_batches`:
    each epoch e shuffles all rows with seed + e, rank r owns rows order[r::world_size] (cut to whole
    micro-batches), and its i-th micro-batch is the i-th slice of micro_batch of them."""

    def __init__(self, n_rows: int, micro_batch: int, world_size: int, seed: int):
        self.n_rows, self.micro_batch, self.world_size, self.seed = n_rows, micro_batch, world_size, seed
        self.batches_per_rank = n_rows // world_size // micro_batch
        if self.batches_per_rank == 0:
            raise LabsError(f"{n_rows} sequences cannot fill one micro-batch of {micro_batch} on each of "
                            f"{world_size} ranks: use more data or a shorter sequence")
        self.epoch = 0

    def set_epoch(self, epoch: int):
        """accelerate and the Trainer call this at the start of every epoch."""
        self.epoch = epoch

    def __len__(self):
        return self.batches_per_rank * self.micro_batch * self.world_size

    def __iter__(self):
        order = torch.randperm(self.n_rows, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        kept = self.batches_per_rank * self.micro_batch
        owned = [order[rank::self.world_size][:kept] for rank in range(self.world_size)]
        for i in range(self.batches_per_rank):
            for rank in range(self.world_size):
                yield from owned[rank][i * self.micro_batch:(i + 1) * self.micro_batch].tolist()


def dealt_batches(rows: torch.Tensor, micro_batch: int, rank: int, world_size: int, seed: int, epoch: int = 0):
    """One epoch of the micro-batches accelerate's dealing gives `rank` from a LabsOrder, built with accelerate's
    own BatchSamplerShard (what `accelerator.prepare` wraps around a DataLoader's batch sampler)."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    sampler = LabsOrder(rows.shape[0], micro_batch, world_size, seed)
    sampler.set_epoch(epoch)
    shard = BatchSamplerShard(BatchSampler(sampler, micro_batch, drop_last=True), num_processes=world_size,
                              process_index=rank)
    for indices in shard:
        yield rows[indices]
