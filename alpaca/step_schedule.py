"""The step schedule both scripts' loops follow: how many optimizer steps, and after which ones to log, evaluate and
save, from the flags and the global batch (the same for 1 and N processes)."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from alpaca.errors import UsageError
from alpaca.sampler import steps_per_epoch


@dataclass(frozen=True)
class StepSchedule:
    global_batch_size: int  # per_device x world_size x accumulation: the same for 1 and N processes
    steps_per_epoch: int
    total_steps: int
    warmup_steps: int
    logging_interval: int
    save_interval: int | None  # None: checkpoints at epoch ends (--save_strategy epoch) or never
    eval_strategy: str = "no"
    eval_interval: int = 1

    @classmethod
    def from_args(cls, args: argparse.Namespace, num_examples: int, world_size: int) -> StepSchedule:
        if num_examples < world_size:
            raise UsageError(f"{num_examples} training examples for {world_size} processes: every process needs "
                             "at least one; use fewer processes or more data")
        global_batch_size = args.per_device_train_batch_size * world_size * args.gradient_accumulation_steps
        epoch_steps = steps_per_epoch(num_examples, global_batch_size)
        total = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * epoch_steps)
        warmup = args.warmup_steps if args.warmup_steps > 0 else math.ceil(args.warmup_ratio * total)

        def interval(steps: float) -> int:
            """Convert an interval flag to steps, with HF semantics: a value below 1 is a fraction of the run."""
            return max(1, math.ceil(steps * total) if steps < 1 else int(steps))

        eval_steps = args.eval_steps or args.logging_steps  # HF: eval_steps defaults to logging_steps
        return cls(global_batch_size, epoch_steps, total, warmup, interval(args.logging_steps),
                   interval(args.save_steps) if args.save_strategy == "steps" else None, args.eval_strategy,
                   interval(eval_steps))

    def should_log(self, step: int) -> bool:
        return step % self.logging_interval == 0 or step == self.total_steps

    def should_evaluate(self, step: int, end_of_epoch: bool) -> bool:
        """Tell whether to evaluate after this step: at each --eval_strategy point, and after the last step so every run
        reports a final eval loss."""
        if self.eval_strategy == "no":
            return False
        if step == self.total_steps:
            return True
        return end_of_epoch if self.eval_strategy == "epoch" else step % self.eval_interval == 0

    def should_save(self, step: int, end_of_epoch: bool, save_strategy: str) -> bool:
        """Tell whether to save a periodic checkpoint after this step.
        (Not after the last one: the final output follows.)"""
        if step == self.total_steps or save_strategy == "no":
            return False
        return end_of_epoch if save_strategy == "epoch" else step % self.save_interval == 0
