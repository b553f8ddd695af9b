"""What the launcher and the cluster tell this process, and how it answers: a stop signal (SIGTERM, SIGINT)
ends the run with a checkpoint. Standard library only."""

from __future__ import annotations

import signal
import time


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
        return 128 + (self.received or 0)
