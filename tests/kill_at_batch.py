"""Run examples/generate.py with one process killed (SIGKILL) as it starts a batch, for the resume tests.

    KILL_RANK=r KILL_BATCH=k [KILL_AFTER=FILE:N] torchrun ... tests/kill_at_batch.py <generate.py flags>

Rank r has finished k - 1 batches (and appended their answers) when it dies. With KILL_AFTER it first waits until
FILE (another rank's answers) holds N lines, so that the kill finds every rank at a known point however loaded the
machine is (torchrun ends the other ranks once one dies).
"""

import os
import runpy
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `alpaca`
import alpaca.generation  # noqa: E402

generate_batch, batches = alpaca.generation.generate_batch, [0]


def killed_at_batch(*args, **kwargs):
    batches[0] += 1
    if batches[0] == int(os.environ["KILL_BATCH"]) and os.environ.get("RANK", "0") == os.environ["KILL_RANK"]:
        if "KILL_AFTER" in os.environ:
            wait_for_lines(*os.environ["KILL_AFTER"].rsplit(":", 1))
        os.kill(os.getpid(), signal.SIGKILL)
    return generate_batch(*args, **kwargs)


def wait_for_lines(path: str, count: str, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if Path(path).exists() and len(Path(path).read_text().splitlines()) >= int(count):
            return
        time.sleep(0.1)


alpaca.generation.generate_batch = killed_at_batch
sys.argv = [str(Path(__file__).resolve().parent.parent / "examples" / "generate.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
