"""A diverging run stops: a step whose loss or gradient norm is not finite is not applied, the run ends on every
rank with one line naming that step and the newest checkpoint, and nothing it writes holds a NaN or an inf; the
check adds no host read to the step."""

import argparse
import collections
import json
import math
import re
import sys

import pytest
import torch
from collective_ledger import check as check_ledger
from conftest import FAULTS, deepspeed_config_file, exit_statuses, run_in_process, torchrun, training_flags
from faults import Fault

import alpaca.strategy
from alpaca.checkpoint import INTERVENTIONS_STATE, TRAINER_STATE, TRAINER_STATE_JSON, load_checkpoint
from alpaca.divergence import ANEW, DIVERGED_EXIT_CODE, way_on
from alpaca.manifest import write_manifest
from alpaca.optim import clip_and_step
from alpaca.output import MetricsLog, plot_loss, read_metrics

# A learning rate that sends the tiny model's interventions to ~1e30 at step 1: its loss is NaN from step 2. A
# checkpoint after every step, and a log every 3 steps: the stop comes at the save point after step 2.
DIVERGING = ["--learning_rate", "1e30", "--max_steps", "6", "--save_steps", "1", "--logging_steps", "3",
             "--save_strategy", "steps", "--num_sample_answers", "0", "--per_device_train_batch_size", "2"]
LINE = re.compile(r"(?:train\.py|train_multigpu\.py): error: the loss or gradient norm is not finite \(NaN or inf\) "
                  r"at step (\d+), which was not applied, and nothing was saved after it; (.*)$", re.MULTILINE)
NEWEST = re.compile(r"resume its newest checkpoint with a lower learning rate: --resume_from_checkpoint (\S+) "
                    r"--learning_rate <lower>")


def last_line(output: str) -> str:
    """The line a terminal shows last: a progress bar redraws its line after a carriage return."""
    return re.split(r"[\r\n]+", output.strip())[-1]


def reject_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def assert_all_finite(output_dir) -> None:
    """Every tensor file (interventions, checkpoints) and every JSON file strictly parsed: no NaN, no inf."""
    for path in sorted(output_dir.rglob("*")):
        if path.suffix in (".bin", ".pt"):
            state = torch.load(path, map_location="cpu", weights_only=True)
            # the RNG states are no values of the run (Python's keeps a NaN for "no Gaussian pending")
            stack = [value for key, value in state.items() if key != "rng"]
            tensors = []
            while stack:
                item = stack.pop()
                if isinstance(item, dict):
                    stack.extend(item.values())
                elif isinstance(item, list | tuple):
                    stack.extend(item)
                elif isinstance(item, torch.Tensor) and item.is_floating_point():
                    tensors.append(item)
            assert tensors and all(torch.isfinite(t).all() for t in tensors), path
        elif path.suffix == ".json":
            json.loads(path.read_text(), parse_constant=reject_constant)
        elif path.suffix == ".jsonl":
            for line in path.read_text().splitlines():
                json.loads(line, parse_constant=reject_constant)


def assert_stopped(statuses: list[int], stderr: str, output_dir, first_step: int, checkpoint_step: int) -> None:
    """Every process exits DIVERGED_EXIT_CODE; the one line (once, whatever the number of ranks) names the step and
    the newest checkpoint, which is intact; nothing non-finite written, no checkpoint after the step, no output."""
    assert statuses and set(statuses) == {DIVERGED_EXIT_CODE}, stderr[-3000:]
    lines = LINE.findall(stderr)
    assert len(lines) == 1, stderr[-3000:]
    step, way_on = lines[0]
    newest = str(output_dir / f"checkpoint-{checkpoint_step}")
    assert int(step) == first_step and NEWEST.fullmatch(way_on)[1] == newest, way_on
    assert max(int(path.name.removeprefix("checkpoint-")) for path in output_dir.glob("checkpoint-*")) == (
        checkpoint_step)
    assert not list(output_dir.glob("intkey_*.bin")) and not (output_dir / "loss.png").exists()
    load_checkpoint(newest)  # intact: its manifest's checksums hold
    assert_all_finite(output_dir)


def test_a_diverging_run_stops_before_saving_and_its_checkpoint_resumes(tiny_model, tiny_data, tmp_path):
    """One process: stopped at step 2 with checkpoint-1 named, the line last on the terminal (the progress bar
    closed first). Resumed from it as the line says, at a rate that would not diverge from a sound start, the run
    diverges again at step 2 (step 1's update sent the interventions to ~1e30): no checkpoint before the one it
    resumed from is kept, so the line says to train anew rather than name checkpoint-1 again."""
    output_dir = tmp_path / "out"
    args = training_flags(tiny_model, tiny_data, output_dir, *DIVERGING)
    status, _, stderr = run_in_process("train.py", args)
    assert_stopped([status], stderr, output_dir, first_step=2, checkpoint_step=1)
    assert LINE.fullmatch(last_line(stderr)), stderr[-3000:]
    status, stdout, stderr = run_in_process("train.py", [*args, "--resume_from_checkpoint", "auto",
                                                        "--learning_rate", "1e-2"])
    assert f"resuming {output_dir / 'checkpoint-1'} at step 1" in stdout, stderr[-3000:]
    assert status == DIVERGED_EXIT_CODE and LINE.fullmatch(last_line(stderr)), stderr[-3000:]
    assert LINE.fullmatch(last_line(stderr))[2] == (
        f"this run resumed from {output_dir / 'checkpoint-1'} and diverged before saving another, and no checkpoint "
        "before it is kept: train anew with a lower --learning_rate and --overwrite_output_dir (without "
        "--resume_from_checkpoint)")
    assert [path.name for path in output_dir.glob("checkpoint-*")] == ["checkpoint-1"]
    assert_all_finite(output_dir)


def test_a_resumed_run_that_diverges_again_is_sent_to_the_checkpoint_before(tiny_model, tiny_data, tmp_path):
    """A non-finite loss at step 5 (tests/faults.py) after checkpoints 2 and 4: checkpoint-4 named. Resumed from it
    and non-finite again at its first step (5), before it saves: the line names checkpoint-2. Resumed from that and
    non-finite at step 3: no checkpoint before it is kept (checkpoint-4, an abandoned run's, is not named); at a
    lower rate the run from checkpoint-2 trains to its end."""
    output_dir = tmp_path / "out"
    args = training_flags(tiny_model, tiny_data, output_dir, "--max_steps", "6", "--save_strategy", "steps",
                          "--save_steps", "2", "--logging_steps", "3", "--num_sample_answers", "0",
                          "--per_device_train_batch_size", "2")
    with Fault("inf_loss", 5):
        status, _, stderr = run_in_process("train.py", args)
    assert_stopped([status], stderr, output_dir, first_step=5, checkpoint_step=4)
    with Fault("inf_loss", 1):  # this process's first step: step 5
        status, _, stderr = run_in_process("train.py", [*args, "--resume_from_checkpoint", "auto"])
    assert status == DIVERGED_EXIT_CODE and LINE.fullmatch(last_line(stderr)), stderr[-3000:]
    assert LINE.fullmatch(last_line(stderr)).groups() == (
        "5", f"this run resumed from {output_dir / 'checkpoint-4'} and diverged before saving another: resume the "
             "checkpoint before it with a lower learning rate: --resume_from_checkpoint "
             f"{output_dir / 'checkpoint-2'} --learning_rate <lower>")
    with Fault("inf_loss", 1):  # its first step (3) again not finite: the abandoned run's checkpoint-4 is no way on
        status, _, stderr = run_in_process("train.py", [*args, "--resume_from_checkpoint", output_dir / "checkpoint-2"])
    assert status == DIVERGED_EXIT_CODE and LINE.fullmatch(last_line(stderr)).groups() == (
        "3", f"this run resumed from {output_dir / 'checkpoint-2'} and diverged before saving another, and no "
             f"checkpoint before it is kept: train anew with a lower --learning_rate and {ANEW}"), stderr[-3000:]
    status, stdout, stderr = run_in_process("train.py", [*args, "--resume_from_checkpoint",
                                                         output_dir / "checkpoint-2", "--learning_rate", "1e-3"])
    assert status == 0 and f"resuming {output_dir / 'checkpoint-2'} at step 2" in stdout, stderr[-3000:]
    assert_all_finite(output_dir)


@pytest.mark.parametrize("strategy", [[], ["--fsdp", "full_shard"], ["--deepspeed", "2"], ["--deepspeed", "3"]],
                         ids=["ddp", "fsdp", "zero2", "zero3"])
def test_a_diverging_run_stops_on_every_rank(tiny_model, tiny_data, tmp_path, strategy):
    """2 processes, under DDP, FSDP, ZeRO-2 (whose engine skips a step with a non-finite gradient itself) and ZeRO-3
    (every parameter partitioned, the interventions gathered for the checkpoint it names): every rank stops, rank 0
    says why (tests/faults.py, with no fault, reports each rank's exit status)."""
    if strategy[:1] == ["--deepspeed"]:
        strategy = ["--deepspeed", str(deepspeed_config_file(tmp_path, int(strategy[1])))]
    output_dir = tmp_path / "out"
    result = torchrun(2, [FAULTS, "train_multigpu.py", *training_flags(tiny_model, tiny_data, output_dir,
                                                                       *DIVERGING, *strategy)],
                      env={"LEDGER": str(tmp_path / "ledger")})
    assert_stopped(exit_statuses(result.stderr), result.stderr, output_dir, first_step=2, checkpoint_step=1)
    check_ledger(tmp_path / "ledger", 2)  # every rank's collectives in step to the end (tests/test_collectives.py)


def test_a_non_finite_loss_on_one_rank_stops_every_rank(tiny_model, tiny_data, tmp_path):
    """Rank 1's loss is inf at step 3, its gradient finite: rank 0 sees nothing itself, and stops all the same."""
    output_dir = tmp_path / "out"
    args = training_flags(tiny_model, tiny_data, output_dir, "--max_steps", "6", "--save_strategy", "steps",
                          "--save_steps", "2",
                          "--logging_steps", "1", "--num_sample_answers", "0", "--per_device_train_batch_size", "2")
    result = torchrun(2, [FAULTS, "train_multigpu.py", *args], env={
        "FAULT": "inf_loss", "FAULT_STEP": "3", "FAULT_RANK": "1", "LEDGER": str(tmp_path / "ledger")})
    assert_stopped(exit_statuses(result.stderr), result.stderr, output_dir, first_step=3, checkpoint_step=2)
    check_ledger(tmp_path / "ledger", 2)
    assert [record["loss"] for record in read_metrics(output_dir)][2] is None  # step 3's window, logged as null


@pytest.mark.fast
@pytest.mark.parametrize("fused", [False, True])
def test_a_non_finite_step_leaves_parameters_and_optimizer_state_unchanged(fused):
    """A NaN gradient, an inf loss with a finite gradient, and a NaN gradient at the very first step: the
    parameters and AdamW's state (its step count too) stay bit for bit as they were. A finite step is
    torch's own, bit for bit."""
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(3))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in parameters]
    optimizer = torch.optim.AdamW(parameters, lr=0.1, weight_decay=0.1, fused=fused)
    reference = torch.optim.AdamW(twins, lr=0.1, weight_decay=0.1, fused=fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

    def step(gradients, loss) -> torch.Tensor:
        for parameter, gradient in zip(parameters, gradients):
            parameter.grad = gradient.clone()
        return clip_and_step(parameters, optimizer, schedule, 1.0, torch.tensor(loss))[1]

    def snapshot() -> list[torch.Tensor]:
        return [p.detach().clone() for p in parameters] + [
            value.clone() for p in parameters for value in optimizer.state[p].values()]

    nan_gradients = [torch.full_like(p, math.nan) for p in parameters]
    assert step(nan_gradients, 1.0)  # the first step: AdamW's state, made by this step, is back to zeros
    assert all(torch.equal(p, twin) for p, twin in zip(parameters, twins))
    assert all(not value.any() for p in parameters for value in optimizer.state[p].values())
    for _ in range(2):
        gradients = [torch.randn_like(p) for p in parameters]
        assert not step(gradients, 1.0)
        for twin, gradient in zip(twins, gradients):
            twin.grad = gradient.clone()
        torch.nn.utils.clip_grad_norm_(twins, 1.0)
        reference.step()
        assert all(torch.equal(p, twin) for p, twin in zip(parameters, twins))
    for gradients, loss in ((nan_gradients, 1.0), ([torch.randn_like(p) for p in parameters], math.inf)):
        before = snapshot()
        assert step(gradients, loss)
        assert all(torch.equal(a, b) for a, b in zip(snapshot(), before, strict=True))


def test_metrics_are_strict_json_and_the_plot_draws_a_gap(tmp_path):
    """A non-finite value is written as null (RFC 8259 has no NaN), read back as None, left out of the last line's
    summary (an eval loss is not checked: it may be null in a finished run), and loss.png draws."""
    log = MetricsLog(tmp_path, argparse.Namespace(report_to="none"))
    for step, loss in ((1, 2.0), (2, math.nan), (3, math.inf), (4, 1.5)):
        log.write({"step": step, "loss": loss, "grad_norm": -math.inf if step == 3 else 1.0})
        log.write({"step": step, "eval_loss": loss})
    assert log.loss_summary() == "loss 2.0000 -> 1.5000, eval loss 2.0000 -> 1.5000"
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert [record["loss"] for record in read_metrics(tmp_path) if "loss" in record] == [2.0, None, None, 1.5]
    assert plot_loss(tmp_path).stat().st_size > 1000


def test_the_step_reads_nothing_from_the_device(tiny_model, tiny_data, tmp_path, monkeypatch):
    """On a GPU, a host read of a device tensor (item, tolist, bool, float, int, index) waits for the step
    (benchmarks/sync_count.py counts them there). On the CPU, each such call from outside torch is counted by
    step: none in a step that neither logs nor saves (the collator's counts are the host's own tensors, built
    in DataLoader workers), and the logging step reads (the counter works)."""
    steps, reads = [0], collections.Counter()
    stepping = alpaca.strategy.clip_and_step

    def counting_steps(*args, **kwargs):
        steps[0] += 1
        return stepping(*args, **kwargs)

    def counting_reads(method):
        def counted(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "/torch/" not in caller and not caller.endswith("collate.py"):
                reads[steps[0]] += 1
            return method(self, *args, **kwargs)
        return counted

    monkeypatch.setattr(alpaca.strategy, "clip_and_step", counting_steps)
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, counting_reads(getattr(torch.Tensor, name)))
    status, _, stderr = run_in_process("train.py", training_flags(
        tiny_model, tiny_data, tmp_path / "out", "--max_steps", "6", "--logging_steps", "100", "--save_strategy",
        "no", "--num_sample_answers", "0", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"))
    monkeypatch.undo()
    assert status == 0, stderr[-3000:]
    assert [reads[step] for step in range(1, 6)] == [0] * 5, reads  # steps 1-5 do not log
    assert reads[6] > 0  # step 6, the last, logs: its loss, grad norm, and whether a step was non-finite


def intact_checkpoint(output_dir, step: int):
    """A checkpoint-<step> directory that checks as complete and intact (its files and their manifest)."""
    path = output_dir / f"checkpoint-{step}"
    path.mkdir(parents=True)
    for name in (INTERVENTIONS_STATE, TRAINER_STATE, TRAINER_STATE_JSON):
        (path / name).write_text(name)
    write_manifest(path)
    return path


@pytest.mark.fast
def test_a_run_resumed_from_another_directory_is_sent_to_that_directory_s_checkpoints(tmp_path):
    """Resumed from other/checkpoint-3 into a new output_dir and diverged before saving: the checkpoint before the one
    it resumed from, other/checkpoint-2, is named where it is (not "train again", which would throw both away);
    other's checkpoints saved after the one this run resumed from are that run's, not this one's past. Once this run
    has saved its own (new/checkpoint-5), that is the newest."""
    other, new = tmp_path / "other", tmp_path / "new"
    for step in (2, 3, 4):
        intact_checkpoint(other, step)
    new.mkdir()
    assert way_on(new, other / "checkpoint-3", 6) == (
        f"this run resumed from {other / 'checkpoint-3'} and diverged before saving another: resume the checkpoint "
        f"before it with a lower learning rate: --resume_from_checkpoint {other / 'checkpoint-2'} --learning_rate "
        "<lower>")
    intact_checkpoint(new, 5)
    assert NEWEST.fullmatch(way_on(new, other / "checkpoint-3", 6))[1] == str(new / "checkpoint-5")
    assert way_on(tmp_path / "third", other / "checkpoint-2", 3) == (
        f"this run resumed from {other / 'checkpoint-2'} and diverged before saving another, and no checkpoint before "
        f"it is kept: train anew with a lower --learning_rate and {ANEW}")
