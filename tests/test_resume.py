"""Checkpoints, exact resume, preemption and crashes, for both scripts."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import FAULTS, REPO, assert_same_model, flags, intervention_weights, run_script, torchrun

from alpaca.checkpoint import checkpoints, latest_checkpoint
from alpaca.output import read_metrics


def assert_identical_runs(actual_dir, expected_dir):
    """Bit-identical weights and the same logged losses at every step."""
    actual, expected = intervention_weights(actual_dir), intervention_weights(expected_dir)
    assert actual.keys() == expected.keys() and actual
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key
    assert [r["step"] for r in read_metrics(actual_dir)] == list(range(1, 10))
    assert [r["loss"] for r in read_metrics(actual_dir)] == [r["loss"] for r in read_metrics(expected_dir)]


def test_kill_9_then_auto_resume_is_bit_identical(tiny_model, tiny_data, tmp_path, reference):
    args = flags(tiny_model, tiny_data, tmp_path, "--gradient_accumulation_steps", "4")
    killed = run_script([FAULTS, "train.py", *args], env={"FAULT": "kill", "FAULT_STEP": "6"})
    assert killed.returncode == -signal.SIGKILL
    assert latest_checkpoint(tmp_path).name == "checkpoint-4"
    resumed = run_script(["train.py", *args, "--resume_from_checkpoint", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout and "at step 4" in resumed.stdout
    assert_identical_runs(tmp_path, reference / "single")


def test_kill_9_of_one_rank_then_auto_resume_is_bit_identical(tiny_model, tiny_data, tmp_path, reference):
    args = ["train_multigpu.py", *flags(tiny_model, tiny_data, tmp_path, "--gradient_accumulation_steps", "2")]
    killed = torchrun(2, [FAULTS, *args], env={"FAULT": "kill", "FAULT_STEP": "6", "FAULT_RANK": "1"})
    assert killed.returncode != 0
    assert latest_checkpoint(tmp_path).name == "checkpoint-4"
    resumed = torchrun(2, [*args, "--resume_from_checkpoint", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_identical_runs(tmp_path, reference / "ddp")


def test_sigterm_checkpoints_exits_non_zero_and_resumes(tiny_model, tiny_data, tmp_path, reference):
    args = flags(tiny_model, tiny_data, tmp_path, "--gradient_accumulation_steps", "4", "--save_strategy", "no")
    stopped = run_script([FAULTS, "train.py", *args], env={"FAULT": "sigterm", "FAULT_STEP": "5"})
    assert stopped.returncode != 0
    assert "stopped by SIGTERM after step 5" in stopped.stderr
    assert [path.name for path in checkpoints(tmp_path)] == ["checkpoint-5"]
    resumed = run_script(["train.py", *args, "--resume_from_checkpoint", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_identical_runs(tmp_path, reference / "single")


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                children.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return children


@pytest.mark.parametrize("target,signal_number", [
    ("torchrun", signal.SIGTERM),  # a launcher or scheduler that signals torchrun, which forwards it
    # SLURM signals every process of the job step: each worker gets it directly and again from torchrun.
    ("every process", signal.SIGTERM),
    ("every process", signal.SIGINT),
])
def test_a_stop_signal_checkpoints_every_rank(tiny_model, tiny_data, tmp_path, target, signal_number):
    args = ["--nproc_per_node", "2", "train_multigpu.py",
            *flags(tiny_model, tiny_data, tmp_path, "--gradient_accumulation_steps", "2", "--max_steps", "400",
                   "--save_strategy", "no")]
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args], cwd=REPO,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})
    deadline = time.monotonic() + 120
    while len(read_metrics(tmp_path)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in [launcher.pid] + (child_pids(launcher.pid) if target == "every process" else []):
        os.kill(pid, signal_number)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode != 0
    assert f"stopped by {signal.Signals(signal_number).name}" in stderr, stderr[-3000:]
    [saved] = checkpoints(tmp_path)
    step = int(saved.name.split("-")[1])
    assert 3 <= step < 400 and [r["step"] for r in read_metrics(tmp_path)][-1] >= step


def test_a_rank_raising_brings_the_job_down_quickly(tiny_model, tiny_data, tmp_path):
    started = time.monotonic()
    result = torchrun(2, [FAULTS, "train_multigpu.py",
                          *flags(tiny_model, tiny_data, tmp_path, "--gradient_accumulation_steps", "2")],
                      env={"FAULT": "raise", "FAULT_STEP": "3", "FAULT_RANK": "1"})
    assert result.returncode != 0
    assert time.monotonic() - started < 60
    assert "injected failure at step 3" in result.stderr


def test_resume_on_another_world_size_with_the_same_global_batch(tiny_model, tiny_data, tmp_path, reference):
    """Two processes x 2 accumulation, killed; resumed by one process x 4 accumulation."""
    multi = [FAULTS, "train_multigpu.py",
             *flags(tiny_model, tiny_data, tmp_path, "--gradient_accumulation_steps", "2", "--dropout", "0")]
    killed = torchrun(2, multi, env={"FAULT": "kill", "FAULT_STEP": "6"})
    assert killed.returncode != 0
    single = flags(tiny_model, tiny_data, tmp_path, "--dropout", "0")
    refused = run_script(["train.py", *single, "--gradient_accumulation_steps", "2", "--resume_from_checkpoint",
                          "auto"])
    assert refused.returncode == 2
    assert ("global batch 8 = 2 per device x 2 processes x 2 accumulation, this run has global batch 4 = 2 per "
            "device x 1 processes x 2 accumulation") in refused.stderr
    resumed = run_script(["train.py", *single, "--gradient_accumulation_steps", "4", "--resume_from_checkpoint",
                          "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_model(tmp_path, reference / "single-no-dropout")


@pytest.mark.parametrize("changed,message", [
    (["--layers", "1;2"], "resume with the original --layers"),
    (["--seed", "7"], "resume with the same data and seed"),
    (["--rank", "2"], "initialized differently"),
])
def test_resume_with_other_interventions_is_refused(tiny_model, tiny_data, tmp_path, reference, changed, message):
    import shutil

    shutil.copytree(reference / "single", tmp_path, dirs_exist_ok=True)
    result = run_script(["train.py", *flags(tiny_model, tiny_data, tmp_path, "--gradient_accumulation_steps", "4"),
                         *changed, "--resume_from_checkpoint", "auto"])
    assert result.returncode == 2
    assert message in result.stderr.strip().splitlines()[-1] and "Traceback" not in result.stderr


def test_a_resumed_run_continues_its_wandb_run(tiny_model, tiny_data, tmp_path):
    """Offline, as in the tests: each start writes a run directory, both carry the id kept in the checkpoint,
    so `wandb sync` appends the resumed part to the same run."""
    args = flags(tiny_model, tiny_data, tmp_path, "--gradient_accumulation_steps", "4", "--save_strategy", "no",
                 "--report_to", "wandb")
    stopped = run_script([FAULTS, "train.py", *args], env={"FAULT": "sigterm", "FAULT_STEP": "5"})
    assert stopped.returncode != 0 and "stopped by SIGTERM after step 5" in stopped.stderr
    run_id = json.loads((tmp_path / "checkpoint-5" / "trainer_state.json").read_text())["wandb_run_id"]
    resumed = run_script(["train.py", *args, "--resume_from_checkpoint", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run_dirs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2 and all(path.name.endswith(f"-{run_id}") for path in run_dirs), run_dirs
    assert b"train/loss" in next(run_dirs[1].glob("run-*.wandb")).read_bytes()
