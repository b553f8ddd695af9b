"""Run train.py or train_multigpu.py with a fault injected at an optimizer step, for the fault tests.

    FAULT=kill|raise|sigterm|sigint|write|enospc FAULT_STEP=k [FAULT_RANK=r] python tests/faults.py train.py <flags>

The fault hits rank r (default 0) during step k, before that step's update: the last finished step is k-1.
`write` instead makes rank r's first write of interventions (a checkpoint's or the output's) after step k-1
fail, as a full disk would; `enospc` fails the write of checkpoint-k half-way, leaving a partial file.
Without FAULT the script runs as it is. Either way, the process-group threads still running when the script
has returned, and the exit status it asks for, are printed last to stderr: a group destroyed for good leaves
no thread.
"""

import errno
import os
import runpy
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `alpaca`
import alpaca.checkpoint  # noqa: E402
import alpaca.deepspeed  # noqa: E402
import alpaca.optim  # noqa: E402
import alpaca.output  # noqa: E402

mode, fault_step = os.environ.get("FAULT"), int(os.environ.get("FAULT_STEP", 0))
on_this_rank = os.environ.get("RANK", "0") == os.environ.get("FAULT_RANK", "0")
clip_gradients, deepspeed_micro_step = alpaca.optim.clip_gradients, alpaca.deepspeed.micro_step
steps = 0


def count_step_with_fault() -> None:
    """A step's update is about to happen."""
    global steps
    steps += 1
    if mode and steps == fault_step and on_this_rank:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode in ("sigterm", "sigint"):
            os.kill(os.getpid(), signal.Signals[mode.upper()])
        elif mode == "raise":
            raise RuntimeError(f"injected failure at step {steps}")


def clip_gradients_with_fault(*args, **kwargs):
    count_step_with_fault()
    return clip_gradients(*args, **kwargs)


def deepspeed_micro_step_with_fault(engine, loss):
    if engine.is_gradient_accumulation_boundary():  # the step's last micro-batch: DeepSpeed updates after it
        count_step_with_fault()
    return deepspeed_micro_step(engine, loss)


save_interventions = alpaca.output.save_interventions
save_checkpoint, write_file = alpaca.checkpoint.save_checkpoint, alpaca.checkpoint.write_file
saving_step = None


def save_interventions_with_fault(*args, **kwargs):
    if mode == "write" and steps >= fault_step - 1 and on_this_rank:
        raise OSError(28, f"No space left on device (injected after step {steps})")
    return save_interventions(*args, **kwargs)


def save_checkpoint_with_fault(output_dir, step, *args, **kwargs):
    global saving_step
    saving_step = step
    return save_checkpoint(output_dir, step, *args, **kwargs)


def write_file_with_fault(path, data: bytes) -> None:
    if mode == "enospc" and saving_step == fault_step:
        write_file(path, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    write_file(path, data)


# The scripts import these when they start training.
alpaca.optim.clip_gradients = clip_gradients_with_fault
alpaca.deepspeed.micro_step = deepspeed_micro_step_with_fault
alpaca.output.save_interventions = save_interventions_with_fault  # the final output
alpaca.checkpoint.save_interventions = save_interventions_with_fault  # checkpoints
alpaca.checkpoint.save_checkpoint = save_checkpoint_with_fault
alpaca.checkpoint.write_file = write_file_with_fault


def process_group_threads() -> list[str]:
    """Names of this process's native threads that gloo and the TCPStore run (Linux /proc)."""
    names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    return sorted(name for name in names if name.startswith(("gloo", "pt_gloo", "pt_tcpstore")))


script, sys.argv = sys.argv[1], sys.argv[1:]
status = 1  # what the interpreter exits with after an uncaught exception
try:
    runpy.run_path(script, run_name="__main__")
    status = 0
except SystemExit as exit:
    status = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
    raise
finally:  # one write: the ranks share torchrun's stderr, and print() writes the newline apart
    sys.stderr.write(f"process-group threads at exit: {process_group_threads()}; exit status {status}\n")
