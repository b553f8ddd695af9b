"""However train_multigpu.py ends, its process group is gone before the interpreter exits.

A group that outlives destroy_process_group keeps gloo's threads running into interpreter shutdown, where
they can abort a process that has finished ("terminate called without an active exception", exit -6): a
usage error then reads as a crash, a finished run as a failed one. tests/faults.py prints the threads left.
"""

from conftest import FAULTS, flags, run_script, threads_left


def test_no_process_group_thread_outlives_a_usage_error(tiny_model, tiny_data, tmp_path):
    """One process, stopped by a usage error found once the group exists; its exit status is asserted exactly.
    On 2 ranks, in test_resume.py: an error (a rank raising), and SIGTERM and SIGINT from outside."""
    args = [FAULTS, "train_multigpu.py", *flags(tiny_model, tiny_data, tmp_path, "--fsdp", "full_shard offload")]
    result = run_script(args)
    assert result.returncode == 2, result.stderr[-3000:]
    assert threads_left(result.stderr) == ["[]"], result.stderr[-3000:]


def test_no_process_group_thread_outlives_a_finished_run(fsdp_runs):
    """Two ranks that finished under FSDP (a run of test_fsdp.py; under DDP: test_multigpu.py's run with
    DataLoader workers)."""
    _, results = fsdp_runs
    assert threads_left(results["fsdp"].stderr) == ["[]", "[]"], results["fsdp"].stderr[-3000:]
