"""Host syncs left in the training step, on CUDA: each call site that blocks the host, and how often per step.

    python benchmarks/sync_count.py train.py --max_steps 12 --logging_steps 1000 ...
    python benchmarks/sync_count.py train_multigpu.py ...       # one process

Runs the script as it is, with torch.cuda.set_sync_debug_mode("warn") switched on from the third optimizer
step (the first two build caches) to the end of training, and counts the synchronizing operations torch reports,
by the innermost frames outside torch. Logging steps, evaluation and the final save are counted too: give
--logging_steps more than --max_steps and no evaluation to see the step alone (the last step always logs).
Those inside a forward (alpaca.loss.token_losses: the model with its interventions, and the loss) are also
counted per forward, and there must be none: the exit status is 1 if one is found.
"""

import collections
import runpy
import sys
import traceback
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `alpaca`
import torch  # noqa: E402

import alpaca.loss  # noqa: E402
import alpaca.optim  # noqa: E402

if not torch.cuda.is_available():
    sys.exit("sync_count.py: the host syncs it counts are CUDA's; run it on a GPU")
FIRST_COUNTED_STEP = 3
clip_and_step = alpaca.optim.clip_and_step
token_losses = alpaca.loss.token_losses
steps = forwards = 0
in_forward = False
sites, forward_sites = collections.Counter(), collections.Counter()


def clip_and_step_counting_steps(*args, **kwargs):
    """Called once per optimizer step, before the optimizer's update: the step counter."""
    global steps
    steps += 1
    if steps == FIRST_COUNTED_STEP:
        torch.cuda.set_sync_debug_mode("warn")
    return clip_and_step(*args, **kwargs)


def token_losses_counting_forwards(*args, **kwargs):
    """Each micro-batch's forward and loss (summed_token_loss calls it): the forward counter, and where it runs."""
    global forwards, in_forward
    forwards += steps >= FIRST_COUNTED_STEP
    in_forward = True
    try:
        return token_losses(*args, **kwargs)
    finally:
        in_forward = False


def record(message, category, filename, lineno, file=None, line=None):
    if "synchroniz" not in str(message):
        return show_warning(message, category, filename, lineno, file, line)
    frames = [frame for frame in traceback.extract_stack()[:-1]
              if "/torch/" not in frame.filename and "/warnings.py" not in frame.filename]
    site = " < ".join(f"{Path(frame.filename).name}:{frame.lineno} {frame.name}" for frame in frames[::-1][:3])
    sites[site] += 1
    forward_sites[site] += in_forward


alpaca.optim.clip_and_step = clip_and_step_counting_steps  # the scripts (and alpaca.strategy) import it when they start
alpaca.loss.token_losses = token_losses_counting_forwards  # looked up at each call by alpaca.loss.summed_token_loss
show_warning, warnings.showwarning = warnings.showwarning, record
warnings.filterwarnings("always", message=".*synchroniz.*")

script, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    torch.cuda.set_sync_debug_mode(0)
    counted = max(steps - FIRST_COUNTED_STEP + 1, 1)
    print(f"\nsynchronizing operations from step {FIRST_COUNTED_STEP} to the end ({counted} steps): "
          f"{sum(sites.values())} in all, {sum(sites.values()) / counted:.1f} per step", file=sys.stderr)
    for site, count in sites.most_common():
        print(f"{count:6d}  ({count / counted:5.1f}/step)  {site}", file=sys.stderr)
    in_forwards = sum(forward_sites.values())
    print(f"inside the {forwards} forwards counted: {in_forwards} ({in_forwards / max(forwards, 1):.1f} per forward)",
          file=sys.stderr)
    for site, count in forward_sites.most_common():
        if count:
            print(f"{count:6d}  ({count / max(forwards, 1):5.1f}/forward)  {site}", file=sys.stderr)
    if in_forwards:
        sys.exit("sync_count.py: the forward blocks the host; it must not")
