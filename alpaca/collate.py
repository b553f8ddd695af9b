"""Collation: tokenized examples -> micro-batches (padded or packed) with their labels, intervention locations
and the counts a step normalizes its loss by."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100


def first_and_last_positions(prompt_length: int, first_n: int, last_n: int) -> tuple[list[int], list[int]]:
    """Return the first-n and the last-n positions of a prompt (--position f<n>+l<n>); `l1` is the last prompt token.

    A prompt shorter than first_n + last_n gets fewer of each so that they never overlap (an overlap
    would apply two interventions of the same layer to one token): the first positions get at most
    half the prompt, the last positions the rest. Positions left out are padded later by the collator
    with a position that cannot affect the loss.
    """
    n_first = min(first_n, prompt_length // 2 if last_n else prompt_length)
    n_last = min(last_n, prompt_length - n_first)
    return list(range(n_first)), list(range(prompt_length - n_last, prompt_length))


def intervention_locations(
    prompt_lengths: list[int], position: tuple[int, int], share_weights: bool, num_layers: int,
    pad_position: int | None, offsets: list[int] | None = None,
) -> list[list[list[int]]]:
    """Build the intervention locations, [intervention][example][position], for pyvene's `unit_locations`.

    Interventions 0..L-1 take the first positions and L..2L-1 the last ones (pyreft's semantics), or
    each takes both when they share weights or --position names only one side. Positions left out by a
    short prompt are padded with `pad_position`, which must be a position whose
    representation never reaches the loss (the batch's last column, see `Collator`); with one
    example and `pad_position=None` they stay short. `offsets`: where each example starts in its row (a
    pack's examples share one row), added to its positions but not to `pad_position`.
    """
    first_n, last_n = position
    firsts, lasts = [], []
    for length, offset in zip(prompt_lengths, offsets or [0] * len(prompt_lengths)):
        first, last = ([offset + p for p in side] for side in first_and_last_positions(length, first_n, last_n))
        if pad_position is not None:
            first += [pad_position] * (first_n - len(first))
            last += [pad_position] * (last_n - len(last))
        firsts.append(first)
        lasts.append(last)
    if first_n and last_n and not share_weights:
        return [firsts] * num_layers + [lasts] * num_layers
    both = [first + last for first, last in zip(firsts, lasts)]
    return [both] * num_layers


# What a pack (Collator.pack) gives the model besides its tokens: position_ids, and the examples' boundaries in
# the form transformers' flash attention takes them (FlashAttentionKwargs); other attention implementations
# ignore the boundaries and find the examples from position_ids.
PACK_KEYS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass
class Collator:
    """Right-pads a micro-batch and builds labels (prompt and padding masked) and intervention locations.

    With `pad_to_multiple_of` N the padded length is rounded up to a multiple of N: a run then sees at most
    model_max_length / N distinct shapes, so shape-keyed caches (cuDNN attention plans, allocator blocks)
    are built once per length instead of once per step. Padding never reaches the loss (see `summed_token_loss`).
    """

    pad_token_id: int
    position: tuple[int, int]
    share_weights: bool
    num_layers: int
    pad_to_multiple_of: int = 1

    def example_labels(self, example: dict[str, Any], ids):
        """Mark the tokens the loss is on: every token after the prompt (the answer and eos), and in a conversation
        its earlier assistant turns (`label_spans`). The loss's kept logits and the step's label count are derived
        from these, so this is the one place to change them."""
        labels = ids.clone()
        labels[: example["prompt_length"]] = IGNORE_INDEX
        for start, end in example.get("label_spans") or ():
            labels[start:end] = ids[start:end]
        return labels

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        longest = max(len(example["input_ids"]) for example in examples)
        width = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        for row, example in enumerate(examples):
            ids = torch.tensor(example["input_ids"], dtype=torch.long)
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
            labels[row, : len(ids)] = self.example_labels(example, ids)
        # Position 0 predicts nothing, so a label there is never counted.
        labels[:, 0] = IGNORE_INDEX
        # Every example has at least one output token after its prompt, so the last column is never a
        # prompt position; its hidden state only feeds its own logits, which predict nothing (causal
        # attention, shifted labels). Intervening there is a no-op: a safe padding position.
        locations = intervention_locations(
            [example["prompt_length"] for example in examples], self.position, self.share_weights,
            self.num_layers, pad_position=width - 1,
        )
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                **self.labels_and_locations(labels, [torch.tensor(positions) for positions in locations], examples)}

    def pack(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        """Collate the examples end to end in one row, with no padding but up to a multiple of `pad_to_multiple_of` at
        the end (--packing). `position_ids` restart at each example: that is how transformers tells them apart (no
        attention across them: a block-diagonal mask under SDPA and eager, varlen kernels under flash attention,
        which also get the examples' boundaries precomputed here, as transformers' DataCollatorWithFlattening
        gives them). Each example's labels and intervened positions are its own, moved to where it starts; its
        first token is not a label (the token before it is another example's), so the seams predict nothing.
        Every per-token loss and gradient is the padded layout's (tests/test_loss.py)."""
        lengths = [len(example["input_ids"]) for example in examples]
        starts = np.cumsum([0, *lengths[:-1]]).tolist()
        used = sum(lengths)
        width = -(-used // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((1, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((1, width), IGNORE_INDEX, dtype=torch.long)
        for start, example in zip(starts, examples):
            ids = torch.tensor(example["input_ids"], dtype=torch.long)
            input_ids[0, start : start + len(ids)] = ids
            labels[0, start : start + len(ids)] = self.example_labels(example, ids)
            labels[0, start] = IGNORE_INDEX
        sequence_lengths = lengths + [width - used] * (width > used)  # the padding at the end: a sequence of its own
        position_ids = torch.cat([torch.arange(length) for length in sequence_lengths]).unsqueeze(0)
        boundaries = torch.tensor(np.cumsum([0, *sequence_lengths]), dtype=torch.int32)
        # The last column is the last example's last token (an answer token, never a prompt position) or
        # padding: a safe padding position, as in __call__. One row holds every example's intervened positions.
        locations = intervention_locations(
            [example["prompt_length"] for example in examples], self.position, self.share_weights,
            self.num_layers, pad_position=width - 1, offsets=starts,
        )
        locations = [torch.tensor([[p for example_positions in positions for p in example_positions]])
                     for positions in locations]
        return {"input_ids": input_ids, "position_ids": position_ids,
                "cu_seq_lens_q": boundaries, "cu_seq_lens_k": boundaries,
                "max_length_q": max(sequence_lengths), "max_length_k": max(sequence_lengths),
                **self.labels_and_locations(labels, locations, examples)}

    def labels_and_locations(self, labels, locations: list, examples: list[dict[str, Any]]) -> dict[str, Any]:
        """Build what a micro-batch carries besides its tokens: labels, intervention locations and their mask, the
        loss's kept logits and the counts, from `labels` and `locations` (whose padding position is the last column)."""
        width = labels.shape[1]
        labelled_columns = (labels != IGNORE_INDEX).any(dim=0).nonzero()
        first_label = int(labelled_columns[0]) if len(labelled_columns) else width
        # True at the real positions, False at the padding ones (the last column is never a real one): a loss
        # term over the intervened positions sums under this mask, or it also sums over padding, which depends
        # on how the step is cut into micro-batches and ranks.
        intervention_mask = [positions != width - 1 for positions in locations]
        return {
            "labels": labels,
            # As tensors, built here (in a DataLoader worker) rather than by pyvene from Python lists in
            # every hook of every forward: see `token_losses`.
            "intervention_locations": locations,
            "intervention_mask": intervention_mask,
            # The loss's kept logits (logits_to_keep) and the label count both come from `labels`, whatever marks
            # them: a label can never be counted yet fall outside the logits kept. Counted here, on the
            # host, so that the training step never reads them back from the device.
            "first_label_position": first_label,
            # The logits the loss needs (from the column before the first label, `token_losses`), counted up to
            # a multiple of pad_to_multiple_of as the width is: no more kept-logit shapes than widths.
            "num_kept_logits": min(width, -(-(width - first_label + 1) // self.pad_to_multiple_of)
                                   * self.pad_to_multiple_of),
            "num_label_tokens": int((labels != IGNORE_INDEX).sum()),
            "num_intervened_positions": int(sum(mask.sum() for mask in intervention_mask)),
            "num_tokens": sum(len(example["input_ids"]) for example in examples),
        }


# What the collator counts in each micro-batch, summed over an optimizer step's micro-batches on every rank
# into the step's counts (`step_counts`), which each micro-batch then carries as batch["step_counts"].
STEP_COUNTS = ("num_label_tokens", "num_intervened_positions")


def step_counts(micro_batches: list[dict[str, Any]]) -> list[int]:
    """Return this process's part of the step's counts, in STEP_COUNTS' order: summed over ranks, the step's."""
    return [sum(batch[key] for batch in micro_batches) for key in STEP_COUNTS]


def give_step_counts(micro_batches: list[dict[str, Any]], counts: list[int]) -> None:
    """Give each micro-batch the whole step's counts: what a loss term normalizes by to stay exact on N ranks."""
    for batch in micro_batches:
        batch["step_counts"] = dict(zip(STEP_COUNTS, counts))


def packs(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Cut the indices of `lengths` into consecutive runs of at most `max_tokens` tokens each (--packing): each
    run takes the next examples while they fit. No example is longer than `max_tokens` (args.validate)."""
    runs, tokens = [], max_tokens
    for index, length in enumerate(lengths):
        if tokens + length > max_tokens:
            runs.append([])
            tokens = 0
        runs[-1].append(index)
        tokens += length
    return runs


@dataclass
class StepCollator:
    """A DataLoader's collate_fn for `DistributedGlobalBatchSampler`: this rank's share of one global batch (its
    micro-batches, concatenated) -> the list of its collated micro-batches, empty for an empty share.

    Only the last micro-batch of a share can be partial (see `rank_micro_batches`), so cutting the share
    every `per_device_batch_size` examples gives back exactly the rank's micro-batches. With
    `packing_max_tokens` (--packing) the share is cut into `packs` instead, each collated into one row."""

    collate: Collator
    per_device_batch_size: int
    packing_max_tokens: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.packing_max_tokens:
            return [self.collate.pack([examples[index] for index in run])
                    for run in packs([example["length"] for example in examples], self.packing_max_tokens)]
        size = self.per_device_batch_size
        return [self.collate(examples[start : start + size]) for start in range(0, len(examples), size)]
