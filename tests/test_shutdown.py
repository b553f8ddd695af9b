"""However train_multigpu.py ends, its process group is gone before the interpreter exits.

A group that outlives destroy_process_group keeps gloo's threads running into interpreter shutdown, where
they can abort a process that has finished ("terminate called without an active exception", exit -6): a
usage error then reads as a crash, a finished run as a failed one. tests/faults.py prints the threads left.
"""

import signal

import pytest
from conftest import FAULTS, flags, run_script, threads_left

CASES = {  # how the run ends: (fault, extra flags, exit status): 128 + the signal number after a stop signal
    "usage error after the group exists": ("", ["--fsdp", "full_shard offload"], 2),
    "SIGTERM": ("sigterm", [], 128 + signal.SIGTERM),
    "SIGINT": ("sigint", [], 128 + signal.SIGINT),
}  # an error: test_resume.py's test_a_rank_raising_brings_the_job_down_quickly


@pytest.mark.parametrize("case", CASES)
def test_no_process_group_thread_outlives_the_run(tiny_model, tiny_data, tmp_path, case):
    """One process; its exit status is asserted exactly."""
    fault, extra, exit_code = CASES[case]
    args = [FAULTS, "train_multigpu.py", *flags(tiny_model, tiny_data, tmp_path, "--max_steps", "3", *extra)]
    result = run_script(args, env={"FAULT": fault, "FAULT_STEP": "2"})
    assert result.returncode == exit_code, result.stderr[-3000:]
    assert threads_left(result.stderr) == ["[]"], result.stderr[-3000:]


@pytest.mark.parametrize("name", ["ddp-gc", "fsdp"])
def test_no_process_group_thread_outlives_a_finished_run(fsdp_runs, name):
    """Two ranks that finished, under DDP and under FSDP (the runs of test_fsdp)."""
    _, results = fsdp_runs
    assert threads_left(results[name].stderr) == ["[]", "[]"], results[name].stderr[-3000:]
