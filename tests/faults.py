"""Run train.py or train_multigpu.py with a fault injected at an optimizer step, for the fault tests.

    FAULT=kill|raise|sigterm|sigint|write|enospc|inf_loss|stall|late FAULT_STEP=k [FAULT_RANK=r] \
        python tests/faults.py train.py <flags>

The fault hits rank r (default 0) during step k, before that step's update: the last finished step is k-1.
Under torchrun --max_restarts, FAULT is a comma-separated list of each attempt's fault in turn
(TORCHELASTIC_RESTART_COUNT; an empty item or the end of the list: that attempt runs clean), e.g. `kill,stall`.
`stall` makes rank r never start the process group (it sleeps where it would join the others), `late` start
it 2 s after the others, as a rank slower to import or to set up its GPU does.
`write` instead makes rank r's first write of interventions (a checkpoint's or the output's) after step k-1
fail in its first tensor file, as a full disk would; `enospc` fails the write of checkpoint-k half-way, leaving
a partial file. `inf_loss` adds inf to each of rank r's micro-batch losses of step k: a non-finite loss on that
rank alone, whose gradient stays finite. `load_base` makes loading the base model (alpaca.model.load_base_model,
every strategy's) fail on every rank: a run that must not load it.
Without FAULT the script runs as it is. With LEDGER=directory its collectives are recorded there
(tests/collective_ledger.py). Either way, the process-group threads still running when the script
has returned, and the exit status it asks for, are printed last to stderr: a group destroyed for good leaves
no thread.

In a test's own process (faults that need no process of their own):
`with Fault("enospc", 4): run_in_process("train.py", argv)`.
"""

import errno
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `alpaca`
import alpaca.checkpoint  # noqa: E402
import alpaca.distributed  # noqa: E402
import alpaca.loss  # noqa: E402
import alpaca.output  # noqa: E402
import alpaca.strategy  # noqa: E402
import alpaca.zero  # noqa: E402


class Fault:
    """While active, the functions the scripts import when they start training are replaced by ones that
    count the optimizer steps and inject `mode` at `fault_step` (on this rank only if `on_this_rank`)."""

    def __init__(self, mode: str | None, fault_step: int, on_this_rank: bool = True):
        self.mode, self.fault_step, self.on_this_rank = mode, fault_step, on_this_rank
        self.steps, self.saving_step = 0, None
        self.replaced = [(alpaca.strategy, "clip_and_step", self.clip_and_step),  # train.py's, DDP's and FSDP's
                         (alpaca.zero, "micro_step", self.deepspeed_micro_step),
                         (alpaca.output, "save_interventions", self.save_interventions),  # the final output
                         (alpaca.checkpoint, "save_interventions", self.save_interventions),  # checkpoints
                         (alpaca.checkpoint, "save_checkpoint", self.save_checkpoint),
                         (alpaca.checkpoint, "write_file", self.write_file),
                         (alpaca.loss, "summed_token_loss", self.summed_token_loss),
                         (alpaca.strategy, "load_base_model", self.load_base_model),
                         (alpaca.distributed, "start_process_group", self.start_process_group)]
        self.original = {(module, name): getattr(module, name) for module, name, _ in self.replaced}

    def __enter__(self):
        for module, name, replacement in self.replaced:
            setattr(module, name, replacement)
        return self

    def __exit__(self, *exc):
        for (module, name), original in self.original.items():
            setattr(module, name, original)

    def count_step(self) -> None:
        """A step's update is about to happen."""
        self.steps += 1
        if self.mode and self.steps == self.fault_step and self.on_this_rank:
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif self.mode in ("sigterm", "sigint"):
                os.kill(os.getpid(), signal.Signals[self.mode.upper()])
            elif self.mode == "raise":
                raise RuntimeError(f"injected failure at step {self.steps}")

    def clip_and_step(self, *args, **kwargs):
        self.count_step()
        return self.original[alpaca.strategy, "clip_and_step"](*args, **kwargs)

    def deepspeed_micro_step(self, engine, loss):
        if engine.is_gradient_accumulation_boundary():  # the step's last micro-batch: DeepSpeed updates after it
            self.count_step()
        return self.original[alpaca.zero, "micro_step"](engine, loss)

    def summed_token_loss(self, *args, **kwargs):
        loss = self.original[alpaca.loss, "summed_token_loss"](*args, **kwargs)
        if self.mode == "inf_loss" and self.steps == self.fault_step - 1 and self.on_this_rank:
            return loss + math.inf
        return loss

    def start_process_group(self, *args, **kwargs):
        if self.mode in ("stall", "late") and self.on_this_rank:
            time.sleep(3600 if self.mode == "stall" else 2)
        return self.original[alpaca.distributed, "start_process_group"](*args, **kwargs)

    def load_base_model(self, *args, **kwargs):
        if self.mode == "load_base":
            raise RuntimeError("injected failure: the base model loads")
        return self.original[alpaca.strategy, "load_base_model"](*args, **kwargs)

    def save_interventions(self, *args, **kwargs):
        save_interventions = self.original[alpaca.output, "save_interventions"]
        if not (self.mode == "write" and self.steps >= self.fault_step - 1 and self.on_this_rank):
            return save_interventions(*args, **kwargs)
        error = OSError(errno.ENOSPC, f"No space left on device (injected after step {self.steps})")

        def cut_short(obj, path, *_, **__) -> None:  # the disk fills up during the first tensor file
            with open(path, "wb") as file:
                file.write(b"\0" * 100)
            raise error

        torch_save, torch.save = torch.save, cut_short
        try:
            save_interventions(*args, **kwargs)
        finally:
            torch.save = torch_save

    def save_checkpoint(self, output_dir, step, *args, **kwargs):
        self.saving_step = step
        return self.original[alpaca.checkpoint, "save_checkpoint"](output_dir, step, *args, **kwargs)

    def write_file(self, path, data: bytes) -> None:
        write_file = self.original[alpaca.checkpoint, "write_file"]
        if self.mode == "enospc" and self.saving_step == self.fault_step:
            write_file(path, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        write_file(path, data)


def process_group_threads() -> list[str]:
    """Names of this process's native threads that gloo and the TCPStore run (Linux /proc)."""
    names = [(task / "comm").read_text().strip() for task in Path("/proc/self/task").iterdir()]
    return sorted(name for name in names if name.startswith(("gloo", "pt_gloo", "pt_tcpstore")))


def fault_from_environment() -> Fault:
    """The fault that FAULT, FAULT_STEP and FAULT_RANK name for this process and this attempt of torchrun's."""
    each_attempt = os.environ.get("FAULT", "").split(",")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return Fault(each_attempt[attempt] if attempt < len(each_attempt) else None, int(os.environ.get("FAULT_STEP", 0)),
                 on_this_rank=os.environ.get("RANK", "0") == os.environ.get("FAULT_RANK", "0"))


if __name__ == "__main__":
    import runpy

    from collective_ledger import install_from_environment

    install_from_environment()  # LEDGER=directory: record the collectives (tests/collective_ledger.py)
    script, sys.argv = sys.argv[1], sys.argv[1:]
    status = 1  # what the interpreter exits with after an uncaught exception
    try:
        with fault_from_environment():
            runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as exit:
        status = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
        raise
    finally:  # one write: the ranks share torchrun's stderr, and print() writes the newline apart
        sys.stderr.write(f"process-group threads at exit: {process_group_threads()}; exit status {status}\n")
