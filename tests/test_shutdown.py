"""However train_multigpu.py ends, its process group is gone before the interpreter exits.

A group that outlives destroy_process_group keeps gloo's threads running into interpreter shutdown, where
they can abort a process that has finished ("terminate called without an active exception", exit -6): a
usage error then reads as a crash, a finished run as a failed one. tests/faults.py prints the threads left.
"""

import re

import pytest
from conftest import FAULTS, flags, run_script, torchrun

CASES = {  # how the run ends: (processes, fault, extra flags, exit code)
    "finished, DDP": (2, "", [], 0),
    "finished, FSDP": (2, "", ["--fsdp", "full_shard"], 0),
    "usage error after the group exists": (1, "", ["--fsdp", "full_shard offload"], 2),
    "stop signal": (1, "sigterm", [], 143),
    "error": (1, "raise", [], 1),
}


@pytest.mark.parametrize("case", CASES)
def test_no_process_group_thread_outlives_the_run(tiny_model, tiny_data, tmp_path, case):
    processes, fault, extra, exit_code = CASES[case]
    args = [FAULTS, "train_multigpu.py", *flags(tiny_model, tiny_data, tmp_path, "--max_steps", "3", *extra)]
    env = {"FAULT": fault, "FAULT_STEP": "2"}
    result = torchrun(processes, args, env=env) if processes > 1 else run_script(args, env=env)
    assert result.returncode == exit_code, result.stderr[-3000:]
    left = re.findall(r"process-group threads at exit: (.*)", result.stderr)
    assert left == ["[]"] * processes, result.stderr[-3000:]
