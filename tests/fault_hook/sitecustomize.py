"""With this directory on PYTHONPATH, each worker that torchrun starts runs with tests/faults.py's FAULT: how the
tests inject a fault into a launch recipe, which starts train_multigpu.py itself. torchrun's own process (no
LOCAL_RANK) runs as it is."""

import os
import sys
from pathlib import Path

if os.environ.get("FAULT") and "LOCAL_RANK" in os.environ:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for faults
    from faults import fault_from_environment

    fault_from_environment().__enter__()  # for the life of the process
