"""Run examples/generate.py with one process killed (SIGKILL) as it starts a batch, for the resume tests.

    KILL_RANK=r KILL_BATCH=k torchrun ... tests/kill_at_batch.py <generate.py flags>

Rank r has finished k - 1 batches (and appended their answers) when it dies.
"""

import os
import runpy
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for `alpaca`
import alpaca.generation  # noqa: E402

generate_batch, batches = alpaca.generation.generate_batch, [0]


def killed_at_batch(*args, **kwargs):
    batches[0] += 1
    if batches[0] == int(os.environ["KILL_BATCH"]) and os.environ.get("RANK", "0") == os.environ["KILL_RANK"]:
        os.kill(os.getpid(), signal.SIGKILL)
    return generate_batch(*args, **kwargs)


alpaca.generation.generate_batch = killed_at_batch
sys.argv = [str(Path(__file__).resolve().parent.parent / "examples" / "generate.py"), *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
