"""Faults as torchelastic recovers them: under `torchrun --max_restarts N` a failed worker makes torchrun restart
every worker, and the restart goes on from the newest checkpoint by itself (--resume_from_checkpoint auto) to the
model of an uninterrupted run, bit for bit. A restarted attempt that waits for a rank that never comes ends
within --ddp_timeout with one line, and our one-line errors are the root cause of torchrun's summary.

On the tiny model in 2 processes (gloo); tests/faults.py injects each fault on the first attempt only."""

import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import DDP, FAULTS, assert_same_run, flags, free_port, run_script, torchrun
from test_resume import files_of

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
STANDALONE = ["--standalone", "--nproc_per_node", "2"]
RESTARTED = ["--resume_from_checkpoint", "auto"]


def root_cause(torchrun_stderr: str) -> str:
    """The "Root Cause" block of torchrun's summary of a failed job."""
    assert "Root Cause (first observed failure)" in torchrun_stderr, torchrun_stderr[-3000:]
    return torchrun_stderr.split("Root Cause (first observed failure)")[1]


def test_kill_9_of_one_rank_is_recovered_by_torchruns_restart(tiny_model, tiny_data, tmp_path, reference):
    """Rank 1 is killed in step 6: torchrun restarts both ranks (standalone rendezvous), which go on from
    checkpoint-4. In the restart rank 1 starts the process group 2 s after rank 0, as ranks on a real machine
    come apart: one that read the addresses of the attempt before would not connect."""
    result = run_script([*STANDALONE, "--max_restarts", "1", FAULTS, "train_multigpu.py",
                         *flags(tiny_model, tiny_data, tmp_path, *DDP), *RESTARTED], launcher=TORCHRUN,
                        env={"FAULT": "kill,late", "FAULT_STEP": "6", "FAULT_RANK": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming {tmp_path / 'checkpoint-4'} at step 4" in result.stdout
    assert_same_run(tmp_path, reference / "ddp", exact=True)


def test_a_rank_raising_on_one_of_two_nodes_is_recovered_by_torchruns_restart(tiny_model, tiny_data, tmp_path,
                                                                              reference):
    """Two 'nodes' of one process each, meeting through c10d rendezvous as on a cluster: the process of the
    second raises in step 6, both torchruns restart their workers, and the job goes on from checkpoint-4."""
    launch = ["--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint",
              f"127.0.0.1:{free_port()}", "--rdzv_id", "elastic", "--max_restarts", "1"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false",
           "FAULT": "raise", "FAULT_STEP": "6", "FAULT_RANK": "1",
           "OMP_NUM_THREADS": "1"}  # as torchrun sets it for 2 processes a node: the reference run's kernels
    nodes = [subprocess.Popen([*TORCHRUN, *launch, FAULTS, "train_multigpu.py",
                               *flags(tiny_model, tiny_data, tmp_path, *DDP), *RESTARTED],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=300) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    assert "injected failure at step 6" in outputs[0][1] + outputs[1][1]
    assert_same_run(tmp_path, reference / "ddp", exact=True)


def test_sigterm_to_one_worker_is_recovered_by_torchruns_restart(tiny_model, tiny_data, tmp_path, reference):
    """Rank 1 is sent SIGTERM in step 5 (static rendezvous at --master_port): every rank finishes the step,
    checkpoints it and exits non-zero (143 and 1), a failure to torchrun, whose restart goes on from
    checkpoint-5."""
    result = torchrun(2, [FAULTS, "train_multigpu.py", *flags(tiny_model, tiny_data, tmp_path, *DDP), *RESTARTED],
                      extra=["--max_restarts", "1"], env={"FAULT": "sigterm", "FAULT_STEP": "5", "FAULT_RANK": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "stopped by a signal to another rank after step 5" in result.stderr
    assert f"resuming {tmp_path / 'checkpoint-5'} at step 5" in result.stdout
    assert_same_run(tmp_path, reference / "ddp", exact=True)


@pytest.mark.parametrize("stalled,waiter_line", [
    ("1", "rank 0 waited --ddp_timeout 10s for the 2 ranks to start the gloo process group"),
    ("0", "rank 1 waited --ddp_timeout 10s for rank 0 to start the process group's store"),
])
def test_a_restarted_rank_that_never_joins_ends_the_job_within_ddp_timeout(tiny_model, tiny_data, tmp_path,
                                                                           stalled, waiter_line):
    """The first attempt stops at a SIGTERM in step 6 (every rank checkpoints and exits 143, one line each); in
    the restart one rank never starts the process group. The other waits --ddp_timeout (10 s) for it, then ends
    with one line naming what it waited for; torchrun, out of restarts, ends the job. Where the waiter is rank 0,
    its line is the root cause of torchrun's summary (a rank that torchrun stopped in the same second would
    otherwise tie with it: torchelastic keeps failure times in whole seconds)."""
    started = time.monotonic()
    result = run_script([*STANDALONE, "--max_restarts", "1", FAULTS, "train_multigpu.py",
                         *flags(tiny_model, tiny_data, tmp_path, *DDP), *RESTARTED, "--ddp_timeout", "10"],
                        launcher=TORCHRUN, env={"FAULT": "sigterm,stall", "FAULT_STEP": "6", "FAULT_RANK": stalled})
    elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("train_multigpu.py: error:")]
    assert len(errors) == 1 and waiter_line in errors[0], result.stderr[-3000:]
    assert result.stderr.count("Traceback (most recent call last)") == 1  # torchrun's own, after our line
    assert elapsed < 120, elapsed  # two starts of the script and one wait of 10 s: not torchrun's 600 s or more
    if stalled == "1":
        assert f"traceback : train_multigpu.py: error: {waiter_line}" in root_cause(result.stderr)


def test_a_usage_error_under_max_restarts_is_one_line_per_attempt_and_the_root_cause(tiny_model, tiny_data,
                                                                                     tmp_path, reference):
    """A mistake in the flags (a finished run's directory and a longer --max_steps) fails each attempt alike:
    torchrun cannot tell it from a fault and tries --max_restarts 2 more times. Each attempt says it in one
    line, none touches the run, and torchrun's summary names the line as the root cause."""
    run = shutil.copytree(reference / "ddp", tmp_path / "run")
    before = files_of(run)
    result = run_script([*STANDALONE, "--max_restarts", "2", "train_multigpu.py",
                         *flags(tiny_model, tiny_data, run, *DDP, "--max_steps", "12"), *RESTARTED],
                        launcher=TORCHRUN)
    line = f"train_multigpu.py: error: the finished run in {run} ended at step 9, this run would end at step 12"
    assert result.returncode == 1
    errors = [text for text in result.stderr.splitlines() if text.startswith("train_multigpu.py: error:")]
    assert len(errors) == 3 and all(text.startswith(line) for text in errors), result.stderr[-3000:]
    assert result.stderr.count("Traceback (most recent call last)") == 1  # torchrun's own, after the lines
    assert f"traceback : {line}" in root_cause(result.stderr)
    assert files_of(run) == before
