"""The training objective: next-token cross-entropy on output tokens, weighted per token over a whole step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alpaca.collate import IGNORE_INDEX, PACK_KEYS, give_step_counts, step_counts
from alpaca.workarounds import set_train_mode


def token_losses(reft_model, batch: dict, device: torch.device, attention_mask: bool = False) -> torch.Tensor:
    """Compute the per-token losses of one micro-batch with the interventions applied: [batch, positions from the first
    label on], 0 where there is no label.

    No attention mask by default. With right padding and causal attention a real token attends to real
    tokens only, and a padded position carries no label and precedes no real token, so the mask changes
    no loss that is summed (tests/test_loss.py checks every label's loss and the gradients). Without it
    SDPA runs plain causal attention: no mask to build, and flash attention is eligible.

    Only positions that predict a label need the vocabulary projection: `logits_to_keep` skips the
    columns before the micro-batch's first label, found by the collator in the labels themselves (the LM
    head is ~a fifth of a small model's FLOPs). It keeps the last `num_kept_logits` positions, a count the collator
    rounds up as it rounds the width (--pad_to_multiple_of): the kept logits take no more shapes than the batches
    do, none new per batch. An int, not a tensor of positions (which transformers also takes): the head then runs
    on a view of the hidden states, not a gathered copy, and the compiled layers (--torch_compile) never see it.
    """
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    first_kept = input_ids.shape[1] - batch["num_kept_logits"]
    inputs = {
        "input_ids": input_ids,
        "logits_to_keep": batch["num_kept_logits"],
        # No KV cache in training: it is never read, and an activation-checkpointed layer recomputed in
        # the backward pass would append its keys to the cache a second time.
        "use_cache": False,
    }
    if attention_mask:
        inputs["attention_mask"] = batch["attention_mask"].to(device, non_blocking=True)
    # A pack of examples in one row (Collator.pack): where each starts, for the attention (no mask, see above).
    inputs.update({key: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
                   for key, value in batch.items() if key in PACK_KEYS})
    # pyvene turns each intervention's locations into an index tensor on the model's device in each hook,
    # with torch.tensor(): from Python lists that is a blocking host-to-device copy per hook; from a tensor
    # already there, a copy on the device. So they go there once per micro-batch, asynchronously.
    locations = [torch.as_tensor(positions).to(device, non_blocking=True)
                 for positions in batch["intervention_locations"]]
    _, outputs = reft_model(inputs, unit_locations={"sources->base": (None, locations)})
    # Position t predicts label t + 1; the first kept logits' columns may precede the first predicting one.
    logits = outputs.logits[:, batch["first_label_position"] - 1 - first_kept : -1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # cross-entropy of bf16 logits in fp32
    # where the head computed the logits (a device map's last device, alpaca.device_map)
    targets = batch["labels"].to(logits.device, non_blocking=True)[:, batch["first_label_position"] :]
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX,
                             reduction="none")
    return losses.view(targets.shape)


def summed_token_loss(reft_model, batch: dict, device: torch.device) -> torch.Tensor:
    """Sum (not average) the per-token losses of one micro-batch, with the interventions applied, on `device`."""
    return token_losses(reft_model, batch, device).sum().to(device)


def token_weighted_loss(summed_loss: torch.Tensor, step_label_tokens: int, world_size: int = 1) -> torch.Tensor:
    """Return the micro-batch's share of the step loss: sum over its tokens / label tokens in the whole step.

    Summed over all micro-batches (and ranks) this is the mean over every label token of the
    optimizer step, so the gradient does not depend on how the step is cut into micro-batches,
    unlike a mean of micro-batch means. DDP averages gradients over ranks, hence `* world_size`.
    """
    return summed_loss * (world_size / step_label_tokens)


@torch.no_grad()
def evaluate(reft_model, dataset, eval_order: list[list[int]], collate, device: torch.device, *, rank: int = 0,
             world_size: int = 1, sharded_base: bool = False) -> torch.Tensor:
    """Compute the summed token loss and the label tokens over this rank's batches of `eval_order` (every
    world_size-th), in float64 on `device`, with the interventions in eval mode (no dropout). Ranks all-reduce these two
    numbers: the eval loss is their ratio.

    A sharded base (FSDP, ZeRO-3) answers only when every rank runs each forward, and ranks may hold one
    batch fewer than others: those run a forward more, whose result is dropped.
    """
    def collated(indices: list[int]) -> dict:
        batch = collate([dataset[i] for i in indices])
        give_step_counts([batch], step_counts([batch]))  # each batch is a step of its own, on any number of ranks
        return batch

    batches = eval_order[rank::world_size]
    num_forwards = -(-len(eval_order) // world_size) if sharded_base else len(batches)
    set_train_mode(reft_model, False)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    try:
        for indices in batches:
            batch = collated(indices)
            totals[0] += summed_token_loss(reft_model, batch, device).double()
            totals[1] += batch["num_label_tokens"]
        for _ in range(num_forwards - len(batches)):
            summed_token_loss(reft_model, collated([0]), device)
    finally:
        set_train_mode(reft_model, True)
    return totals
