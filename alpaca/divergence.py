"""A diverging run stops: the loss or gradient norm of a step is not finite. The strategy undoes such a step on the
device and notes it (alpaca.strategy.Strategy.step); the scripts ask at the points where the host reads the device
anyway (a logging step, before a checkpoint, before the output) and stop there, before anything is saved."""

from __future__ import annotations

import os
import sys

from tqdm.auto import tqdm

from alpaca.checkpoint import latest_checkpoint

DIVERGED_EXIT_CODE = 3  # neither a usage error (2) nor a crash or failed write (1): a requeue would diverge again


def exit_if_diverged(strategy, prog: str, output_dir: str | os.PathLike, metrics) -> None:
    """Stop a diverged run: every rank calls it (a collective under torch.distributed). If a step was not finite, the
    rank that logs (rank 0, whose `metrics` are not disabled) says, in one line, which step and where to resume from,
    then closes its log (wandb's finish can take a while, and torchrun ends a straggler once the other ranks have
    exited); every rank exits DIVERGED_EXIT_CODE."""
    first = strategy.first_non_finite_step()
    if first is None:
        return
    if not metrics.disable:
        newest = latest_checkpoint(output_dir)
        way_on = (f"resume its newest checkpoint with a lower learning rate: --resume_from_checkpoint {newest} "
                  "--learning_rate <lower>" if newest is not None
                  else "no checkpoint was saved before it: train again with a lower --learning_rate")
        # tqdm.write: on a line of its own, under the progress bar
        tqdm.write(f"{prog}: error: the loss or gradient norm is not finite (NaN or inf) at step {first}, which was "
                   f"not applied, and nothing was saved after it; {way_on}", file=sys.stderr)
        sys.stderr.flush()  # before torchrun's report of the failed ranks
        metrics.close()
    sys.exit(DIVERGED_EXIT_CODE)
