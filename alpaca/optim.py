"""The optimizer (AdamW and its parameter groups), the learning-rate schedule, clipping and the step that a
non-finite loss or gradient undoes, shared by both scripts."""

from __future__ import annotations

import argparse
import math

import torch
from transformers import get_scheduler

from alpaca.model import intervention_parameters
from alpaca.step_schedule import StepSchedule


def optimizer_param_groups(reft_model, weight_decay: float) -> list[dict]:
    """Split the interventions' parameters into AdamW groups. The rotation of LoReFT, DiReFT, LobiReFT and ConsReFT is
    torch's orthogonal parametrization (Householder map), whose underlying parameter keeps +-1 signs on its diagonal,
    read with `.int()`: one step of decoupled weight decay turns 1.0 into 0.99..., which truncates to 0 and
    zeroes the rotation (the loss goes flat). So no parametrized parameter gets weight decay; nor do
    biases, as usual."""
    decay, no_decay = [], []
    for name, parameter in intervention_parameters(reft_model):
        (no_decay if ".parametrizations." in name or name.endswith("bias") else decay).append(parameter)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(reft_model, args: argparse.Namespace, schedule: StepSchedule):
    """Build AdamW (rotation and biases without weight decay) and the HF schedule named by --lr_scheduler_type."""
    optimizer = torch.optim.AdamW(optimizer_param_groups(reft_model, args.weight_decay), lr=args.learning_rate,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                                  fused=True if args.optim == "adamw_torch_fused" else None)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=schedule.warmup_steps,
                              num_training_steps=schedule.total_steps)
    return optimizer, scheduler


def clip_and_step(parameters: list[torch.Tensor], optimizer: torch.optim.Optimizer, scheduler,
                  max_grad_norm: float, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip to --max_grad_norm (0 disables), step the optimizer (undone where the step's `loss` or gradient norm
    is not finite) and the schedule, clear the gradients. Returns the norm before clipping and whether the step
    was undone, on the device: reading them would make the host wait for the step, so they are read only when
    logged or before something is saved."""
    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm if max_grad_norm > 0 else math.inf)
    skipped = non_finite(loss, grad_norm)
    masked_step(optimizer, skipped)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, skipped


def non_finite(loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
    """Return True, on the device, where the step's loss or gradient norm is inf or NaN. The loss is checked too: an
    infinite loss need not make the gradient non-finite (a loss clamped or detached on the way, a term whose
    gradient vanishes)."""
    return ~(torch.isfinite(loss).to(grad_norm.device) & torch.isfinite(grad_norm))


def masked_step(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """Run optimizer.step(), undone on the device where `skip` is true, as GradScaler's skipped step (which only torch's
    fused optimizers take, and then with their own numerics): the parameters and the optimizer state are put back
    as they were, the state a first step creates back to zeros, AdamW's fresh state. The host never reads `skip`.
    A step count that torch keeps on the host while `skip` is on a GPU (AdamW but fused or capturable) counts the
    undone step: only the first undone step matters, since the run stops at the next point it reads `skip`,
    before anything is saved. The trainable parameters are a few thousand values: copying them is cheap."""
    parameters = [p for group in optimizer.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in parameters]
    before_state = {(index, key): value.clone() for index, p in enumerate(parameters)
                    for key, value in optimizer.state.get(p, {}).items() if isinstance(value, torch.Tensor)}
    optimizer.step()
    after = [*zip((p.detach() for p in parameters), before),
             *((value, before_state.get((index, key))) for index, p in enumerate(parameters)
               for key, value in optimizer.state.get(p, {}).items() if isinstance(value, torch.Tensor))]
    for tensor, old in after:
        if tensor.device.type == skip.device.type:
            old = torch.zeros_like(tensor) if old is None else old
            tensor.copy_(torch.where(skip.to(tensor.device, non_blocking=True), old, tensor))
