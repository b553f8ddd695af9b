"""However train_multigpu.py ends, its process group is gone before the interpreter exits.

A group that outlives destroy_process_group keeps gloo's threads running into interpreter shutdown, where
they can abort a process that has finished ("terminate called without an active exception", exit -6): a
usage error then reads as a crash, a finished run as a failed one. tests/faults.py prints the threads left.
"""

from conftest import flags, run_in_process, threads_left
from faults import process_group_threads


def test_no_process_group_thread_outlives_a_usage_error(tiny_model, tiny_data, tmp_path):
    """One process, stopped by a usage error found once the group exists (--fsdp offload without CUDA); its exit
    status is asserted exactly.
    In this process: the threads it would leave are this process's. On 2 ranks, in test_resume.py: an error (a
    rank raising), and SIGTERM and SIGINT from outside."""
    assert process_group_threads() == []  # none left by an earlier run in this process
    status, _, stderr = run_in_process("train_multigpu.py", flags(tiny_model, tiny_data, tmp_path, "--fsdp",
                                                                  "full_shard offload"))
    assert status == 2 and "--fsdp offload keeps the shards in CPU memory for GPUs" in stderr, stderr[-3000:]
    assert process_group_threads() == []


def test_no_process_group_thread_outlives_a_finished_run(fsdp_runs):
    """Two ranks that finished under FSDP (a run of test_fsdp.py; under DDP: test_multigpu.py's run with
    DataLoader workers)."""
    _, result = fsdp_runs
    assert threads_left(result.stderr) == ["[]", "[]"], result.stderr[-3000:]
