"""A diverging run stops: the loss or gradient norm of a step is not finite. The strategy undoes such a step on the
device and notes it (alpaca.strategy.Strategy.step); the scripts ask at the points where the host reads the device
anyway (a logging step, before a checkpoint, before the output) and stop there, before anything is saved."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from alpaca.checkpoint import checkpoints, is_complete, step_of

DIVERGED_EXIT_CODE = 3  # neither a usage error (2) nor a crash or failed write (1): a requeue would diverge again
ANEW = "--overwrite_output_dir (without --resume_from_checkpoint)"


def exit_if_diverged(strategy, prog: str, output_dir: str | os.PathLike, resumed_from: Path | None, metrics,
                     progress) -> None:
    """Stop a diverged run: every rank calls it (a collective under torch.distributed). If a step was not finite, the
    rank that logs (rank 0, whose `metrics` are not disabled) closes its tqdm `progress` bar (else it is drawn again
    under the line), says in one line which step and where to go on from (way_on), then closes its log (wandb's
    finish can take a while, and torchrun ends a straggler once the other ranks have exited); every rank exits
    DIVERGED_EXIT_CODE. `resumed_from`: the checkpoint this run started from, or None."""
    first = strategy.first_non_finite_step()
    if first is None:
        return
    if not metrics.disable:
        progress.close()
        print(f"{prog}: error: the loss or gradient norm is not finite (NaN or inf) at step {first}, which was not "
              f"applied, and nothing was saved after it; {way_on(output_dir, resumed_from, first)}", file=sys.stderr)
        sys.stderr.flush()  # before torchrun's report of the failed ranks
        metrics.close()
    sys.exit(DIVERGED_EXIT_CODE)


def way_on(output_dir: str | os.PathLike, resumed_from: Path | None, diverged_step: int) -> str:
    """Say where a diverged run goes on at a lower learning rate: its newest intact checkpoint from before the diverged
    step (a newer one is an abandoned run's); where that is the one the run itself resumed from, the intact one before
    it, as the weights it holds may be what diverges (a step with a finite loss can send them to ~1e30, the next one's
    loss is NaN); else anew. The checkpoints are output_dir's and, for a run resumed from another directory, those of
    that directory up to the one it resumed from (the later ones are that run's, not this one's past)."""
    kept = [path for path in checkpoints(output_dir) if step_of(path) < diverged_step and is_complete(path)]
    if resumed_from is not None and Path(resumed_from).parent.resolve() != Path(output_dir).resolve():
        earlier = [path for path in checkpoints(Path(resumed_from).parent)
                   if step_of(path) <= step_of(Path(resumed_from)) and is_complete(path)]
        kept = sorted(earlier + kept, key=step_of)  # stable: at one step, output_dir's is the newer
    if not kept:
        return f"no checkpoint was saved before it: train again with a lower --learning_rate and {ANEW}"
    newest = kept[-1]
    if resumed_from is None or newest.resolve() != Path(resumed_from).resolve():
        return ("resume its newest checkpoint with a lower learning rate: --resume_from_checkpoint "
                f"{newest} --learning_rate <lower>")
    resumed = f"this run resumed from {newest} and diverged before saving another"
    if len(kept) == 1:
        return f"{resumed}, and no checkpoint before it is kept: train anew with a lower --learning_rate and {ANEW}"
    return (f"{resumed}: resume the checkpoint before it with a lower learning rate: --resume_from_checkpoint "
            f"{kept[-2]} --learning_rate <lower>")
