"""Checkpoints, exact resume, preemption and crashes, for both scripts."""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from conftest import (
    DDP,
    EACH_RANK_ENDS_ON_ITS_OWN,
    FAULTS,
    REPO,
    SINGLE,
    assert_every_rank_left_on_its_own,
    assert_same_run,
    copy_as_killed,
    exit_statuses,
    flags,
    free_port,
    run_in_process,
    run_script,
    threads_left,
    torchrun,
)

from alpaca.args import build_parser
from alpaca.checkpoint import checkpoints, latest_checkpoint, prepare_output_dir
from alpaca.errors import UsageError
from alpaca.manifest import MANIFEST, sha256
from alpaca.output import FINISHED_FILE, read_metrics
from alpaca.resume import BOUND_OTHERWISE, NOT_BOUND, bound_flag_values, bound_flags, check_fingerprint


def test_kill_9_then_auto_resume_from_the_one_epoch_checkpoint_kept_is_bit_identical(tiny_model, tiny_data, tmp_path,
                                                                                     reference):
    """--save_strategy epoch --save_total_limit 1: killed in step 5, only checkpoint-3 (the end of epoch 1, inside
    a logging window of 2 steps) is there; the resumed run starts epoch 2 from it, writes checkpoint-6 and deletes
    checkpoint-3. (The resume in this process: only the kill needs a process of its own.)"""
    args = flags(tiny_model, tiny_data, tmp_path, *SINGLE, "--save_strategy", "epoch", "--save_total_limit", "1")
    killed = run_script([FAULTS, "train.py", *args], env={"FAULT": "kill", "FAULT_STEP": "5"})
    assert killed.returncode == -signal.SIGKILL
    assert [path.name for path in checkpoints(tmp_path)] == ["checkpoint-3"]
    status, stdout, stderr = run_in_process("train.py", [*args, "--resume_from_checkpoint", "auto"])
    assert status == 0, stderr[-3000:]
    assert "resuming" in stdout and "at step 3" in stdout
    assert [path.name for path in checkpoints(tmp_path)] == ["checkpoint-6"]
    assert_same_run(tmp_path, reference / "single", exact=True)


def test_kill_9_of_one_rank_then_auto_resume_is_bit_identical(tiny_model, tiny_data, tmp_path, reference):
    """Resumed from checkpoint-4, inside a logging window (every 3 steps) that both ranks had begun."""
    args = ["train_multigpu.py", *flags(tiny_model, tiny_data, tmp_path, *DDP)]
    killed = torchrun(2, [FAULTS, *args], env={"FAULT": "kill", "FAULT_STEP": "6", "FAULT_RANK": "1"})
    assert killed.returncode != 0
    assert latest_checkpoint(tmp_path).name == "checkpoint-4"
    resumed = torchrun(2, [*args, "--resume_from_checkpoint", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_run(tmp_path, reference / "ddp", exact=True)


@pytest.fixture(scope="module")
def stopped_and_resumed(tiny_model, tiny_data, tmp_path_factory):
    """train.py stopped by SIGTERM after step 5 (inside a logging window of 2 steps), then resumed; reporting
    to wandb (offline). The stop in a process of its own (the exit status is the signal's), the resume in this
    one; for the tests below."""
    output_dir = tmp_path_factory.mktemp("stopped")
    args = flags(tiny_model, tiny_data, output_dir, *SINGLE, "--save_strategy", "no", "--report_to", "wandb")
    stopped = run_script([FAULTS, "train.py", *args], env={"FAULT": "sigterm", "FAULT_STEP": "5"})
    checkpoints_when_stopped = [path.name for path in checkpoints(output_dir)]
    resumed = run_in_process("train.py", [*args, "--resume_from_checkpoint", "auto"])
    return output_dir, stopped, checkpoints_when_stopped, resumed


def test_sigterm_checkpoints_exits_143_and_resumes(stopped_and_resumed, reference):
    output_dir, stopped, checkpoints_when_stopped, resumed = stopped_and_resumed
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.stderr[-3000:]
    assert "stopped by SIGTERM after step 5" in stopped.stderr
    assert checkpoints_when_stopped == ["checkpoint-5"]
    assert resumed[0] == 0, resumed[2][-3000:]
    assert_same_run(output_dir, reference / "single", exact=True)


def test_sigint_checkpoints_and_exits_130(tiny_model, tiny_data, tmp_path, monkeypatch):
    """Ctrl-C: in this process (the exit status the script asks for; the SIGTERM test above sees a real one)."""
    import alpaca.strategy

    clip_and_step = alpaca.strategy.clip_and_step
    steps = []

    def interrupted_in_step_3(*args, **kwargs):
        steps.append(1)
        if len(steps) == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return clip_and_step(*args, **kwargs)

    monkeypatch.setattr(alpaca.strategy, "clip_and_step", interrupted_in_step_3)
    status, _, stderr = run_in_process("train.py", flags(tiny_model, tiny_data, tmp_path, *SINGLE,
                                                         "--save_strategy", "no"))
    assert status == 128 + signal.SIGINT, stderr[-3000:]
    assert "stopped by SIGINT after step 3" in stderr
    assert [path.name for path in checkpoints(tmp_path)] == ["checkpoint-3"]


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
    """Each rank checkpoints, exits with 128 + the signal number (as SLURM and torchrun users read it), and has
    destroyed its process group before its interpreter exits (tests/faults.py, without a fault, reports both).
    On a bf16 base, which no other run of 2 ranks uses."""
    args = ["--nproc_per_node", "2", "--master_port", str(free_port()), FAULTS, "train_multigpu.py",
            *flags(tiny_model, tiny_data, tmp_path, "--gradient_accumulation_steps", "2", "--max_steps", "400",
                   "--save_strategy", "no", "--dtype", "bfloat16")]
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
    assert exit_statuses(stderr) == [128 + signal_number] * 2 and threads_left(stderr) == ["[]"] * 2, stderr[-3000:]
    [saved] = checkpoints(tmp_path)
    step = int(saved.name.split("-")[1])
    assert 3 <= step < 400 and [r["step"] for r in read_metrics(tmp_path)][-1] >= step


def test_a_rank_raising_brings_the_job_down_quickly(tiny_model, tiny_data, tmp_path):
    """Rank 1 raises in step 3; rank 0, waiting for it in a collective, fails at once too. torchrun is told to look
    at its workers only every 10 s: each rank must end on its own, with the error's exit status, its process
    group gone before its interpreter exits (tests/faults.py reports both; test_shutdown.py: the other ways a
    run ends)."""
    started = time.monotonic()
    result = torchrun(2, [FAULTS, "train_multigpu.py", *flags(tiny_model, tiny_data, tmp_path, *DDP)],
                      extra=EACH_RANK_ENDS_ON_ITS_OWN, env={"FAULT": "raise", "FAULT_STEP": "3", "FAULT_RANK": "1"})
    assert result.returncode != 0
    assert time.monotonic() - started < 60
    assert "injected failure at step 3" in result.stderr
    assert_every_rank_left_on_its_own(result.stderr)
    assert threads_left(result.stderr) == ["[]", "[]"], result.stderr[-3000:]


@pytest.mark.parametrize("changed,message", [
    (["--layers", "1;3"], "resume with the original --layers"),
    (["--seed", "7"], "resume with the same data and seed"),
    (["--rank", "2"], "initialized differently"),
])
def test_resume_with_other_interventions_is_refused(tiny_model, tiny_data, tmp_path, reference, changed, message):
    """In this process: the refusal is a usage error like any other (tested as such in a fresh one)."""
    copy_as_killed(reference / "single", tmp_path, 8)
    status, _, stderr = run_in_process("train.py", [*flags(tiny_model, tiny_data, tmp_path, *SINGLE), *changed,
                                                    "--resume_from_checkpoint", "auto"])
    assert status == 2
    assert message in stderr.strip().splitlines()[-1] and "Traceback" not in stderr


def test_resume_with_another_prompt_template_is_refused(tiny_model, tiny_data, tmp_path, reference):
    """A checkpoint trained on chat-rendered prompts, resumed with the Alpaca prompt: refused, not trained on
    other text (the checkpoint's record is rewritten, its manifest updated to match)."""
    copy_as_killed(reference / "single", tmp_path, 8)
    checkpoint = latest_checkpoint(tmp_path)
    state_file, manifest_file = checkpoint / "trainer_state.json", checkpoint / "manifest.json"
    state_file.write_text(json.dumps({**json.loads(state_file.read_text()), "prompt_template": "chat"}))
    manifest = json.loads(manifest_file.read_text())
    manifest["files"]["trainer_state.json"] = {"bytes": state_file.stat().st_size, "sha256": sha256(state_file)}
    manifest_file.write_text(json.dumps(manifest))
    status, _, stderr = run_in_process("train.py", [*flags(tiny_model, tiny_data, tmp_path, *SINGLE),
                                                    "--resume_from_checkpoint", "auto"])
    assert status == 2
    assert stderr.strip().splitlines()[-1].endswith("resume with --prompt_template chat"), stderr[-2000:]


def test_a_resumed_run_continues_its_wandb_run(stopped_and_resumed):
    """Offline, as in the tests: each start writes a run directory, both carry the id kept in the checkpoint,
    so `wandb sync` appends the resumed part to the same run."""
    tmp_path, stopped, _, resumed = stopped_and_resumed
    assert stopped.returncode != 0 and "stopped by SIGTERM after step 5" in stopped.stderr
    run_id = json.loads((tmp_path / "checkpoint-5" / "trainer_state.json").read_text())["wandb_run_id"]
    assert resumed[0] == 0, resumed[2][-3000:]
    run_dirs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 2 and all(path.name.endswith(f"-{run_id}") for path in run_dirs), run_dirs
    assert b"train/loss" in next(run_dirs[1].glob("run-*.wandb")).read_bytes()


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*"))
            if path.is_file()}


def refused_resume(run_dir: Path, args: list[str]) -> str:
    """The last line of a resume that must be refused (exit 2, one line) leaving `run_dir` as it was."""
    before = files_of(run_dir)
    status, _, stderr = run_in_process("train.py", [*args, "--resume_from_checkpoint", "auto"])
    assert status == 2, stderr[-3000:]
    assert "Traceback" not in stderr
    assert files_of(run_dir) == before
    return stderr.strip().splitlines()[-1]


def test_resume_on_edited_data_is_refused(tiny_model, tiny_data, tmp_path, reference):
    """The data file edited after the checkpoint: as many records, one training answer changed."""
    from alpaca.data import load_splits

    copy_as_killed(reference / "single", tmp_path / "run", 8)
    records = json.loads(tiny_data.read_text())
    trained_on = load_splits(str(tiny_data), eval_split_ratio=0.15, seed=42)[0][0]  # the reference runs' split
    edited = next(record for record in records if record["instruction"] == trained_on["instruction"])
    edited["output"] += " Indeed."
    (tmp_path / "edited.json").write_text(json.dumps(records))
    message = refused_resume(tmp_path / "run", flags(tiny_model, tmp_path / "edited.json", tmp_path / "run", *SINGLE))
    assert message.startswith("train.py: error: this run differs from the checkpoint in the training data (the "
                              "records of --data_path"), message
    assert "Resume with the data, model and flags the checkpoint was trained with" in message


def test_resume_on_another_base_model_is_refused(tiny_model, tiny_data, tmp_path, reference):
    """A model of the same architecture and shapes, with other weights (one tensor changed)."""
    from safetensors.torch import load_file, save_file

    copy_as_killed(reference / "single", tmp_path / "run", 8)
    other = shutil.copytree(tiny_model, tmp_path / "other-model")
    weights = load_file(other / "model.safetensors")
    weights["model.layers.3.mlp.down_proj.weight"] *= 1.01
    save_file(weights, other / "model.safetensors", metadata={"format": "pt"})
    message = refused_resume(tmp_path / "run", flags(other, tiny_data, tmp_path / "run", *SINGLE))
    assert message == (f"train.py: error: this run differs from the checkpoint in the base model's weights "
                       f"(--model_name_or_path '{other}'). Resume with the data, model and flags the checkpoint was "
                       "trained with (its training_args.json), or train anew in another --output_dir")


@pytest.mark.parametrize("changed,difference", [
    (["--model_max_length", "256"], "--model_max_length (512 in the checkpoint, 256 in this run)"),
    # the same interventions (keys, shapes, initial weights) at other prompt positions
    (["--position", "f1+l1"], "--position (f2+l2 in the checkpoint, f1+l1 in this run)"),
    # restored from the optimizer state, it would be ignored without a word
    (["--adam_beta2", "0.99"], "--adam_beta2 (0.999 in the checkpoint, 0.99 in this run)"),
])
def test_resume_with_other_arithmetic_is_refused(tiny_model, tiny_data, tmp_path, reference, changed, difference):
    copy_as_killed(reference / "single", tmp_path / "run", 8)
    message = refused_resume(tmp_path / "run", [*flags(tiny_model, tiny_data, tmp_path / "run", *SINGLE), *changed])
    assert message.startswith(f"train.py: error: this run differs from the checkpoint in {difference}. "), message


def test_a_resume_at_another_learning_rate_goes_on_at_its_peak(tiny_model, tiny_data, tmp_path, reference):
    """checkpoint-8 resumed at half the --learning_rate (a diverging run's way on): said in one line, and the
    schedule goes on from its step at the new peak: the logged rate is half the uninterrupted run's."""
    copy_as_killed(reference / "single", tmp_path / "run", 8)
    status, stdout, stderr = run_in_process("train.py", [
        *flags(tiny_model, tiny_data, tmp_path / "run", *SINGLE), "--learning_rate", "0.005",
        "--resume_from_checkpoint", "auto"])
    assert status == 0, stderr[-3000:]
    assert "Resuming at --learning_rate 0.005 (the checkpoint's: 0.01); the schedule goes on from step 8" in stdout
    rate = {run: [r["learning_rate"] for r in read_metrics(run) if r["step"] == 9 and "loss" in r]
            for run in (reference / "single", tmp_path / "run")}
    assert rate[tmp_path / "run"] == [rate[reference / "single"][0] / 2] and rate[tmp_path / "run"][0] > 0


def test_resume_past_the_end_is_refused(tiny_model, tiny_data, tmp_path, reference):
    """A resume that would train 0 steps (checkpoint-8, --max_steps 5)."""
    copy_as_killed(reference / "single", tmp_path / "run", 8)
    message = refused_resume(tmp_path / "run", [*flags(tiny_model, tiny_data, tmp_path / "run", *SINGLE),
                                                "--max_steps", "5"])
    assert message.endswith("the checkpoint is at step 8 and this run ends at step 5: nothing to train; raise "
                            "--max_steps or --num_train_epochs (the checkpoint loads as an output as it is)")


def test_a_checkpoint_without_a_fingerprint_is_refused(tiny_model, tiny_data, tmp_path, reference):
    """A checkpoint that records no data, model and flags (the field stripped, the manifest updated to match):
    its resume cannot be checked, so it is refused in one line, the run directory left as it was."""
    copy_as_killed(reference / "single", tmp_path, 6)
    state_file, manifest_file = tmp_path / "checkpoint-6" / "trainer_state.json", tmp_path / "checkpoint-6" / MANIFEST
    state = json.loads(state_file.read_text())
    del state["fingerprint"]
    state_file.write_text(json.dumps(state))
    manifest = json.loads(manifest_file.read_text())
    manifest["files"]["trainer_state.json"] = {"bytes": state_file.stat().st_size, "sha256": sha256(state_file)}
    manifest_file.write_text(json.dumps(manifest))
    message = refused_resume(tmp_path, flags(tiny_model, tiny_data, tmp_path, *SINGLE))
    assert message.endswith("the checkpoint records no fingerprint of its data, base model and flags, so this resume "
                            "cannot be checked against them; resume it with the version of these scripts that wrote "
                            "it, or train anew in another --output_dir")


def documented_bound_flags() -> set[str]:
    """The flags docs/checkpoints.md lists as bound as given."""
    page = " ".join((REPO / "docs" / "checkpoints.md").read_text().split())
    listed = page[page.index("Bound as given"): page.index("The optimizer state would silently")]
    return set(re.findall(r"`--(\w+)`", listed))


@pytest.mark.fast
def test_every_flag_is_bound_unless_listed():
    """Each flag of either script's parser is bound as given (and then listed as such in docs/checkpoints.md), or on
    exactly one of the lists of flags a checkpoint is not bound to as given. A flag added to the parser is bound,
    and fails here until it is documented as bound or listed."""
    parsed = [set(vars(build_parser(script, multigpu).parse_args([]))) for script, multigpu in
              (("train.py", False), ("train_multigpu.py", True))]
    every_flag = set.union(*parsed)
    assert set(NOT_BOUND) <= every_flag and set(BOUND_OTHERWISE) <= every_flag  # no stale name
    assert not set(NOT_BOUND) & set(BOUND_OTHERWISE)
    assert len(set(NOT_BOUND)) == len(NOT_BOUND) and len(set(BOUND_OTHERWISE)) == len(BOUND_OTHERWISE)
    assert set(bound_flags()) == every_flag - set(NOT_BOUND) - set(BOUND_OTHERWISE) == documented_bound_flags()
    assert set(bound_flags()) <= parsed[0]  # train.py's checkpoints resume under train_multigpu.py and back


# A value other than the reference runs' for each bound flag (a flag newly bound needs one here).
CHANGED_FLAGS = {"dtype": "bfloat16", "load_in_4bit": True, "load_in_8bit": True, "bnb_4bit_quant_type": "fp4",
                 "bnb_4bit_use_double_quant": True, "model_max_length": 256, "group_by_length": False,
                 "layers": "0;3", "position": "l1", "share_weights": True, "rank": 2, "dropout": 0.2,
                 "intervention": "nodireft", "component": "attention_output",
                 "weight_decay": 0.1, "adam_beta1": 0.8, "adam_beta2": 0.99, "adam_epsilon": 1e-6,
                 "max_grad_norm": 0.5, "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "warmup_steps": 3}


@pytest.mark.fast
@pytest.mark.parametrize("name", bound_flags())
def test_a_resume_that_changes_a_bound_flag_is_refused_naming_it(name):
    """The check a resume makes (alpaca.resume.check_fingerprint), on the reference runs' flags and on them with
    one bound flag changed: refused in one line naming that flag alone, with both values."""
    def fingerprint(args):
        dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
        return {"data": "records", "model": {"config": "c", "tokenizer": "t", "weights": "w"},
                "flags": bound_flag_values(args, num_layers=4, dtype=dtype)}

    saved = build_parser("train.py").parse_args(flags("model", "data.json", "out", *SINGLE))
    check_fingerprint(json.loads(json.dumps(fingerprint(saved))), fingerprint(saved), saved)  # as written, read
    changed = argparse.Namespace(**{**vars(saved), name: CHANGED_FLAGS[name]})
    with pytest.raises(UsageError) as refusal:
        check_fingerprint(json.loads(json.dumps(fingerprint(saved))), fingerprint(changed), changed)
    message = str(refusal.value)
    assert message.startswith(f"this run differs from the checkpoint in --{name} (") and "\n" not in message
    assert message.count("in this run)") == 1


def test_a_finished_run_requeued_is_left_as_it_is(tiny_model, tiny_data, tmp_path, reference, monkeypatch):
    """--resume_from_checkpoint auto in the reference run's directory (finished at step 9), as a requeued job
    runs it: one line, exit 0, no step trained and no file touched. With another bound flag: refused like any
    resume, and so is another --learning_rate (which a checkpoint's resume may change). Asked for more steps:
    refused, naming the newest checkpoint to go on from, which then trains the longer run; for fewer: refused.
    All decided before the base model loads: its loading fails until the longer run."""
    run = shutil.copytree(reference / "single", tmp_path / "run")
    args = flags(tiny_model, tiny_data, run, *SINGLE)
    before = files_of(run)

    def refuse_to_load(*args, **kwargs):
        raise AssertionError("a requeue of a finished run loaded the base model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse_to_load)
    status, stdout, stderr = run_in_process("train.py", [*args, "--resume_from_checkpoint", "auto"])
    assert status == 0, stderr[-3000:]
    assert stdout.strip().splitlines()[-1] == (f"Nothing to train: {run} holds this run, finished at step 9 with "
                                               "these data, model and flags (to train it again: "
                                               "--overwrite_output_dir without --resume_from_checkpoint)")
    assert stdout.count("Nothing to train") == 1 and "Trained to step" not in stdout
    assert files_of(run) == before

    message = refused_resume(run, [*args, "--adam_beta2", "0.99"])
    assert message == ("train.py: error: this run differs from the finished run in --adam_beta2 (0.999 in the "
                       "finished run, 0.99 in this run). Resume with the data, model and flags the finished run was "
                       "trained with (its training_args.json), or train anew in another --output_dir")
    message = refused_resume(run, [*args, "--max_steps", "11"])
    assert message == (f"train.py: error: the finished run in {run} ended at step 9, this run would end at step 11; "
                       "a finished run keeps no optimizer state to go on from: resume its newest checkpoint with "
                       f"--resume_from_checkpoint {run / 'checkpoint-8'}, or train anew with --overwrite_output_dir "
                       "(without --resume_from_checkpoint)")
    message = refused_resume(run, [*args, "--learning_rate", "0.005"])  # a resume may change it, a finished run not
    assert message == (f"train.py: error: the finished run in {run} was trained at --learning_rate 0.01, this run "
                       "has 0.005; a finished run keeps no optimizer state to go on from: resume one of its "
                       "checkpoints at the new rate with --resume_from_checkpoint, or train anew with "
                       "--overwrite_output_dir (without --resume_from_checkpoint)")
    message = refused_resume(run, [*args, "--max_steps", "5"])
    assert message.endswith("ended at step 9, this run would end at step 5; a finished run keeps no optimizer state "
                            "to go on from: train anew with --overwrite_output_dir (without "
                            "--resume_from_checkpoint)")
    message = refused_resume(run, flags(tiny_model, tiny_data, run, *SINGLE, "--seed", "7"))
    assert message == ("train.py: error: the finished run was written with --seed 42 on 17 examples, this run has "
                       "--seed 7; resume with the same data and seed")
    monkeypatch.undo()
    status, stdout, stderr = run_in_process("train.py", [*args, "--max_steps", "11", "--resume_from_checkpoint",
                                                         run / "checkpoint-8"])
    assert status == 0, stderr[-3000:]
    assert "at step 8" in stdout
    assert json.loads((run / FINISHED_FILE).read_text())["step"] == 11


def test_a_finished_run_requeued_on_two_processes_is_left_as_it_is(tiny_model, tiny_data, tmp_path, reference):
    """The same under torchrun: every rank exits 0, the line printed once (rank 0), no file touched, no base model
    loaded (tests/faults.py makes loading it fail on every rank)."""
    run = shutil.copytree(reference / "ddp", tmp_path / "run")
    before = files_of(run)
    result = torchrun(2, [FAULTS, "train_multigpu.py", *flags(tiny_model, tiny_data, run, *DDP),
                          "--resume_from_checkpoint", "auto"], env={"FAULT": "load_base"})
    assert result.returncode == 0 and exit_statuses(result.stderr) == [0, 0], result.stderr[-3000:]
    assert result.stdout.count("Nothing to train") == 1
    assert f"Nothing to train: {run} holds this run, finished at step 9" in result.stdout
    assert files_of(run) == before


@pytest.mark.fast
def test_a_damaged_record_of_a_finished_run_is_refused(tmp_path):
    """Cut short (by hand or by the disk: it is renamed into place whole): one line, before anything loads."""
    (tmp_path / FINISHED_FILE).write_text('{"step": 9, "geo')
    args = build_parser("train.py").parse_args(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "auto"])
    with pytest.raises(UsageError, match=f"^{tmp_path / FINISHED_FILE} is damaged; train anew with "
                                         r"--overwrite_output_dir \(without --resume_from_checkpoint\)$"):
        prepare_output_dir(args)
