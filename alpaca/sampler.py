"""The global batch plan: which examples each optimizer step takes, and each rank's share of them, the same for
any number of processes; the DataLoader settings that walk it."""

from __future__ import annotations

import math
import signal

import numpy as np
from torch.utils.data import Sampler

from alpaca.collate import packs

MEGABATCH = 50  # global batches per length-sorted group, as in HF's LengthGroupedSampler


def global_batches(num_examples: int, global_batch_size: int, seed: int, epoch: int,
                   lengths: np.ndarray | None = None, shuffle: bool = True) -> list[list[int]]:
    """Cut the epoch's example order into global batches (one may be partial).

    It depends only on (seed, epoch, the examples' lengths, global batch size): one process and N
    processes with the same global batch walk through exactly the same batches, which is what makes
    them train the same model, and a resumed run finds its place again.

    With `lengths` (--group_by_length), the shuffled order is cut into megabatches of MEGABATCH global
    batches, each sorted by length (longest first) and cut into global batches of similar lengths,
    whose order is then shuffled. A micro-batch is padded to its longest example, so this removes most
    padding. The trade-off: a step's examples are no longer a uniform sample of lengths, so the loss
    varies more from step to step (long and short answers have different per-token losses).
    Without `shuffle`, the dataset's order (and, with `lengths`, the megabatches' order).
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(num_examples) if shuffle else np.arange(num_examples)
    if lengths is None:
        return [order[i : i + global_batch_size].tolist() for i in range(0, num_examples, global_batch_size)]
    span = global_batch_size * MEGABATCH
    batches = []
    for start in range(0, num_examples, span):
        megabatch = order[start : start + span]
        megabatch = megabatch[np.argsort(-lengths[megabatch], kind="stable")]
        batches += [megabatch[i : i + global_batch_size].tolist() for i in range(0, len(megabatch), global_batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))] if shuffle else batches


class DistributedGlobalBatchSampler(Sampler[list[int]]):
    """The global batch plan as a DataLoader `batch_sampler`, with DistributedSampler's interface
    (num_replicas, rank, shuffle, seed, set_epoch) and a resume position (`set_start`).

    Each item is this rank's share of one global batch, i.e. of one optimizer step: its micro-batches of
    `rank_micro_batches`, concatenated (`StepCollator` cuts them again); an empty share is an empty list,
    so every rank yields one item per step. The plan is `global_batches`: the same for any number of
    replicas with the same global batch (per_device x num_replicas x accumulation).
    """

    def __init__(self, num_examples: int, per_device_batch_size: int, accumulation_steps: int = 1,
                 num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0,
                 lengths: np.ndarray | None = None, packing: tuple[np.ndarray, int] | None = None) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.num_examples, self.per_device_batch_size = num_examples, per_device_batch_size
        self.accumulation_steps, self.num_replicas, self.rank = accumulation_steps, num_replicas, rank
        self.shuffle, self.seed, self.lengths = shuffle, seed, lengths
        self.packing = packing  # (every example's length, --packing_max_tokens), as StepCollator packs
        self.global_batch_size = per_device_batch_size * num_replicas * accumulation_steps
        self.start = 0
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Draw a new order for each epoch, as with DistributedSampler; call it before each epoch's iteration."""
        self.epoch = epoch
        self.global_batches = global_batches(self.num_examples, self.global_batch_size, self.seed, epoch,
                                             self.lengths, self.shuffle)

    def set_start(self, batch_index: int) -> None:
        """Iterate from this global batch of the epoch on: where a resumed run goes on."""
        self.start = batch_index

    def __len__(self) -> int:
        """Count the items (optimizer steps) left in this epoch from the start position."""
        return max(0, len(self.global_batches) - self.start)

    def __iter__(self):
        for global_batch in self.global_batches[self.start :]:
            yield self.share(global_batch, self.rank)

    def share(self, global_batch: list[int], rank: int) -> list[int]:
        """Concatenate `rank`'s micro-batches of a global batch."""
        micro_batches = rank_micro_batches(global_batch, rank, self.num_replicas, self.per_device_batch_size,
                                           self.accumulation_steps)
        return [index for micro_batch in micro_batches for index in micro_batch]

    def micro_steps(self, batch_index: int) -> int:
        """Count the forwards every rank runs in this global batch of the epoch: the accumulation steps, or with packing
        the most packs a rank's share makes (a rank with fewer makes up the rest with placeholders where the
        strategy's collectives need them). Every rank finds the same, with no communication."""
        if self.packing is None:
            return self.accumulation_steps
        lengths, max_tokens = self.packing
        return max(len(packs(lengths[self.share(self.global_batches[batch_index], rank)].tolist(), max_tokens))
                   for rank in range(self.num_replicas))


def rank_micro_batches(
    global_batch: list[int], rank: int, world_size: int, per_device_batch_size: int, accumulation_steps: int
) -> list[list[int]]:
    """Return this rank's `accumulation_steps` micro-batches of a global batch.

    The global batch is cut into consecutive chunks of `per_device_batch_size`; chunk k goes to
    micro-step k // world_size of rank k % world_size. In a partial global batch some
    micro-batches are empty: the rank still takes part in the step with a zero contribution.
    """
    chunks = [
        global_batch[start : start + per_device_batch_size]
        for start in range(0, len(global_batch), per_device_batch_size)
    ]
    chunks += [[]] * (world_size * accumulation_steps - len(chunks))
    return chunks[rank::world_size]


def eval_batches(lengths: np.ndarray, batch_size: int) -> list[list[int]]:
    """Sort the evaluation set by length (least padding) and cut it into batches. The eval loss is a sum over
    tokens, so it does not depend on how the batches are spread over ranks."""
    order = np.argsort(-lengths, kind="stable")
    return [order[i : i + batch_size].tolist() for i in range(0, len(order), batch_size)]


def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
    return math.ceil(num_examples / global_batch_size)


def dataloader_worker_init(worker_id: int) -> None:
    """Make a DataLoader worker ignore SIGTERM and SIGINT. A cluster or a terminal signals every process of the
    job, workers included; a worker dying of it would fail the step that waits for its batch before
    the main process, which handles the signal (alpaca.signals.StopSignal), could checkpoint. The main
    process ends its workers itself, and a worker whose parent is gone exits on its own."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
