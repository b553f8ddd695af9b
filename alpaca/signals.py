"""Stop signals (SIGTERM, SIGINT), which end the run with a checkpoint, and the wait of a rank that found a usage
error for the launcher's signal. Standard library only."""

from __future__ import annotations

import signal
import time

LAUNCHER_WAIT_S = 30


def wait_for_launcher() -> None:
    """Wait (up to LAUNCHER_WAIT_S) for the launcher to stop this process once rank 0 has exited, on a rank other
    than 0 which has found a mistake that rank 0 usually finds too and reports. Leaving first could get rank
    0 stopped before it has printed. A stop signal ends the wait and the process, whatever handlers training
    installed."""
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, signal.SIG_DFL)
    time.sleep(LAUNCHER_WAIT_S)


class StopSignal:
    """SIGTERM (preemption, torchrun forwarding) or SIGINT: finish the step, checkpoint, exit non-zero.

    A worker often gets the same request twice: from the terminal or the cluster, which signal the whole
    process group or cgroup, and again from torchrun, which forwards what it got. So a repeated SIGTERM is
    ignored, and only a second Ctrl-C (SIGINT) given after DUPLICATE_S seconds aborts at once.
    """

    DUPLICATE_S = 2.0

    def __init__(self) -> None:
        self.received: int | None = None
        self.received_at = 0.0
        for number in (signal.SIGTERM, signal.SIGINT):
            signal.signal(number, self._handle)

    def _handle(self, number: int, frame) -> None:
        if self.received is None:
            self.received, self.received_at = number, time.monotonic()
        elif number == signal.SIGINT and time.monotonic() - self.received_at > self.DUPLICATE_S:
            raise KeyboardInterrupt

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    @property
    def exit_code(self) -> int:
        """128 + the signal's number; 1 where the signal came to another rank of the run."""
        return 128 + self.received if self.received else 1

    def stopped_line(self, prog: str, step: int, checkpoint) -> str:
        return (f"{prog}: stopped by {self.name or 'a signal to another rank'} after step {step}; checkpoint in "
                f"{checkpoint}. Resume with --resume_from_checkpoint auto")
