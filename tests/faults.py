"""Run train.py or train_multigpu.py with a fault injected at an optimizer step, for the fault tests.

    FAULT=kill|raise|sigterm FAULT_STEP=k [FAULT_RANK=r] python tests/faults.py train.py <flags>

The fault hits rank r (default 0) during step k, before that step's update: the last finished step is k-1.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `alpaca`
import alpaca.optim  # noqa: E402

mode, fault_step = os.environ["FAULT"], int(os.environ["FAULT_STEP"])
on_this_rank = os.environ.get("RANK", "0") == os.environ.get("FAULT_RANK", "0")
clip_gradients = alpaca.optim.clip_gradients
steps = 0


def clip_gradients_with_fault(*args, **kwargs):
    global steps
    steps += 1
    if steps == fault_step and on_this_rank:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            raise RuntimeError(f"injected failure at step {steps}")
    return clip_gradients(*args, **kwargs)


alpaca.optim.clip_gradients = clip_gradients_with_fault  # the scripts import it when they start training
script, sys.argv = sys.argv[1], sys.argv[1:]
runpy.run_path(script, run_name="__main__")
