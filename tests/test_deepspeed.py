"""train_multigpu.py --deepspeed CONFIG.json (ZeRO-1, 2 and 3, gloo on CPU): the model DDP trains, resume from
its checkpoints, and clear errors for configs that cannot work."""

import json
import math
import re

import pytest
import torch
from conftest import (
    DDP,
    DEEPSPEED_CONFIGS,
    FAULTS,
    FLOAT32_ROUNDING,
    FLOAT64_RTOL,
    NOISE_MARGIN,
    REPO,
    assert_same_run,
    copy_as_killed,
    deepspeed_config_file,
    flags,
    intervention_weights,
    logged_values,
    relative_deviation,
    run_in_process,
    torchrun,
    training_flags,
    truth_run,
)

from alpaca.checkpoint import TRAINER_STATE, checkpoints
from alpaca.model import load_base_model
from alpaca.output import load_reft_model
from alpaca.zero import own_partition

READ_COUNT = str(REPO / "tests" / "read_count.py")
ZERO2 = DEEPSPEED_CONFIGS / "zero2.json"


def test_a_zero2_run_stopped_and_resumed_under_zero1_trains_the_model_of_ddp(tiny_model, tiny_data, tmp_path,
                                                                              reference):
    """The reference runs' flags (dropout, eval, checkpoints every 2 steps, logging every 3 steps; a last global
    batch of 1 example, so rank 1 runs placeholders only, two under ZeRO and one under DDP, which draw no dropout
    masks) under ZeRO-2: rank 1 alone gets SIGTERM in step 5 (inside a logging window and an epoch), and the run
    resumes from the checkpoint the stop writes under ZeRO-1 (a checkpoint holds torch's optimizer state,
    whatever the stage). Steps 1-5 and 6-9 together are the uninterrupted DDP run: weights, losses, grad norms
    (which a constant factor in the gradient would change, though AdamW hides it from the weights) and eval
    losses within float noise (ZeRO sums in another order; a lost optimizer state, RNG state or logging window
    is far above it). The checkpoints load as outputs. ZeRO-3: below."""
    args = ["train_multigpu.py", *flags(tiny_model, tiny_data, tmp_path, *DDP)]
    stopped = torchrun(2, [FAULTS, *args, "--deepspeed", deepspeed_config_file(tmp_path, 2)],
                       env={"FAULT": "sigterm", "FAULT_STEP": "5", "FAULT_RANK": "1"})
    assert stopped.returncode != 0 and "stopped by a signal to another rank after step 5" in stopped.stderr, \
        stopped.stderr[-3000:]
    assert "base model replicated (DeepSpeed ZeRO-2)" in stopped.stdout
    assert checkpoints(tmp_path)[-1].name == "checkpoint-5"
    result = torchrun(2, [*args, "--deepspeed", deepspeed_config_file(tmp_path, 1), "--resume_from_checkpoint", "auto"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 5" in result.stdout and "base model replicated (DeepSpeed ZeRO-1)" in result.stdout
    assert "shm_comm" not in result.stdout + stopped.stdout  # nothing compiled on CPU
    assert_same_run(tmp_path, reference / "ddp")
    assert_loads_as_outputs(tmp_path, tiny_model)


def assert_loads_as_outputs(output_dir, model_dir) -> None:
    """The output, and each checkpoint as an output, give pyreft's model the saved rotations."""
    base, _ = load_base_model(str(model_dir), torch.float32, torch.device("cpu"))
    for loaded in (output_dir, *checkpoints(output_dir)):
        reft_model = load_reft_model(loaded, base)
        saved = intervention_weights(loaded)
        for key, intervention in reft_model.interventions.items():
            assert torch.equal(intervention.rotate_layer.weight, saved[f"intkey_{key}.bin/rotate_layer"])


def test_zero3_resumes_a_single_process_checkpoint_to_the_ddp_model(runs, tmp_path, tiny_tied_model):
    """ZeRO-3 partitions the base and the interventions. The optimizer state of a checkpoint is torch AdamW's,
    whole per parameter, under DeepSpeed as without it: `runs`' one-process run (train.py, here with a
    checkpoint every 2 steps) is resumed at step 4 under ZeRO-3 on 2 ranks. The run ends with the DDP run's
    weights and logged values (float noise), writes checkpoints (6, 8) whose optimizer state is the
    one-process run's and which load as outputs. Each rank holds half the base's parameter bytes, and both run
    every forward of the evaluation (3 batches: 2 on rank 0, 1 on rank 1) and of the sample answer. No rank
    ever loads the whole base: each reads only its partitions from the model's safetensors files (counted by
    tests/read_count.py: half of each tensor, rounded up, and at most the rest of the rows it starts and ends
    in)."""
    root, data = runs
    every_2_steps = ["--save_strategy", "steps", "--save_steps", "2"]
    single = tmp_path / "single"
    status, _, stderr = run_in_process("train.py", [*data, "--output_dir", single, "--per_device_train_batch_size",
                                                    "2", "--gradient_accumulation_steps", "4", *every_2_steps])
    assert status == 0, stderr[-3000:]
    output_dir = copy_as_killed(single, tmp_path / "out", 4)
    result = torchrun(2, [READ_COUNT, "train_multigpu.py", *data, "--output_dir", str(output_dir),
                          "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2", *every_2_steps,
                          "--deepspeed",
                          str(deepspeed_config_file(tmp_path, 3)), "--num_sample_answers", "1", "--max_new_tokens", "4",
                          "--resume_from_checkpoint", "auto"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at step 4" in result.stdout and "base model sharded (DeepSpeed ZeRO-3)" in result.stdout
    assert_same_run(output_dir, root / "ddp")
    base_bytes = [json.loads((path / "training_args.json").read_text())["base_parameter_bytes_per_rank"]
                  for path in (output_dir, root / "ddp")]
    assert base_bytes[0] == pytest.approx(base_bytes[1] / 2, rel=0.02), base_bytes
    bytes_read = [int(count) for count in re.findall(r"safetensors bytes read: (\d+)", result.stderr)]
    whole, owned = checkpoint_bytes(tiny_tied_model, world_size=2)
    assert len(bytes_read) == 2 and all(whole / 2 <= read <= owned for read in bytes_read), (bytes_read, whole, owned)
    assert "rank 0: " in result.stdout and "Instruction: Name three primary colors." in result.stdout
    truth = truth_run(single)
    for name in ("checkpoint-6", "checkpoint-8"):
        saved, uninterrupted, exact = (torch.load(path / name / TRAINER_STATE, weights_only=True)["optimizer"]
                                       for path in (output_dir, single, truth))
        assert saved["param_groups"] == uninterrupted["param_groups"]
        assert saved["state"].keys() == uninterrupted["state"].keys()
        moments = [(index, key) for index in uninterrupted["state"] for key in ("exp_avg", "exp_avg_sq")]
        # Adam's moments are sums of the gradients (and their squares): their rounding error is that of the
        # one-process run's against its float64 truth (conftest.NOISE_MARGIN says why this margin)
        tolerance = NOISE_MARGIN * max(FLOAT32_ROUNDING, *(relative_deviation(uninterrupted["state"][index][key],
                                                                              exact["state"][index][key])
                                                           for index, key in moments))
        for index, key in moments:
            assert torch.equal(saved["state"][index]["step"], uninterrupted["state"][index]["step"])
            deviation = relative_deviation(saved["state"][index][key], uninterrupted["state"][index][key])
            assert deviation <= tolerance, (name, index, key, deviation, tolerance)
    assert_loads_as_outputs(output_dir, tiny_tied_model)


def checkpoint_bytes(model_dir, world_size: int) -> tuple[int, int]:
    """The bytes of the tensors in the model's safetensors files, and those of one rank's ZeRO-3 partition of
    each (1/world_size of it, rounded up) with the rest of the rows it starts and ends in."""
    from safetensors import safe_open

    whole = owned = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(file, framework="pt") as opened:
            for name in opened.keys():
                tensor = opened.get_tensor(name)
                row = tensor[0].numel() if tensor.dim() else 1
                whole += tensor.nbytes
                owned += (math.ceil(tensor.numel() / world_size) + 2 * row) * tensor.element_size()
    return whole, owned


# The bf16 runs log every step, so that the first step's loss (before any update) is compared too.
BF16 = [*DDP, "--logging_steps", "1", "--dtype", "bfloat16"]


@pytest.fixture(scope="module")
def ddp_bf16(tiny_model, tiny_data, tmp_path_factory):
    """The reference DDP run (2 ranks) on a bf16 base."""
    output_dir = tmp_path_factory.mktemp("ddp-bf16")
    result = torchrun(2, ["train_multigpu.py", *flags(tiny_model, tiny_data, output_dir, *BF16)])
    assert result.returncode == 0, result.stderr[-3000:]
    return output_dir


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_on_a_bf16_base_trains_the_model_of_ddp(tiny_model, tiny_data, tmp_path, ddp_bf16, stage):
    """examples/deepspeed's configs ("bf16": {"enabled": "auto"}) with --dtype bfloat16: the base stays in bf16
    (partitioned in bf16 under ZeRO-3), the interventions and their optimizer state in float32. Each rank runs
    the same bf16 base on the same micro-batches as under DDP, so the first step's loss is DDP's exactly. After
    it, the float32 gradients summed and the update applied in another order move an intervention's weights in
    the last bits, which can flip a bf16 rounding of its output by a whole bf16 spacing (2^-8): from there on
    the two runs are as far apart as bf16 rounding takes them, which `assert_same_run` measures as the DDP run's
    distance from the same run in float32. The output loads."""
    result = torchrun(2, ["train_multigpu.py", *flags(tiny_model, tiny_data, tmp_path, *BF16, "--deepspeed",
                                                      deepspeed_config_file(tmp_path, stage))])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"(DeepSpeed ZeRO-{stage})" in result.stdout and "(torch.bfloat16)" in result.stdout
    assert all(tensor.dtype != torch.bfloat16 for tensor in intervention_weights(tmp_path).values())
    assert logged_values(tmp_path)["loss"][1] == logged_values(ddp_bf16)["loss"][1]
    assert_same_run(tmp_path, ddp_bf16)
    assert_loads_as_outputs(tmp_path, tiny_model)


BAD_CONFIGS = [
    # (name, config text or None for a missing file, extra flags, what stderr must say)
    ("missing file", None, [], "cannot read it"),
    ("invalid json", '{"zero_optimization": {"stage": 2},}', [], "invalid JSON at line 1"),
    ("stage 7", json.dumps({"zero_optimization": {"stage": 7}}), [], "stage 7 does not exist here; use 1, 2 or 3"),
    ("micro-batch", json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}), [],
     "train_micro_batch_size_per_gpu 4 disagrees with --per_device_train_batch_size (2)"),
    ("optimizer", json.dumps({"zero_optimization": {"stage": 2},
                              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "eps": "auto"}}}), [],
     'optimizer {"lr": 0.0003}: the optimizer comes from --learning_rate'),
    ("offload on cpu", json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}), [],
     "offload_optimizer moves state from GPUs to the CPU"),
    ("zero3 offload on cpu", (DEEPSPEED_CONFIGS / "zero3_offload.json").read_text(), [],
     "offload_optimizer moves state from GPUs to the CPU"),
    ("zero3 param offload on cpu", json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}),
     [], "offload_param moves state from GPUs to the CPU"),
    ("with fsdp", ZERO2.read_text(), ["--fsdp"], "--fsdp and --deepspeed are exclusive"),
    ("compiled", ZERO2.read_text(), ["--torch_compile"], "--torch_compile is not yet tested with --deepspeed"),
    ("fp16", ZERO2.read_text(), ["--dtype", "float16"], "a float16 base needs loss scaling"),
    ("with packing", ZERO2.read_text(), ["--packing"], "--packing and --deepspeed do not combine"),
]


@pytest.mark.fast
@pytest.mark.parametrize("name,text,extra,message", BAD_CONFIGS, ids=[case[0] for case in BAD_CONFIGS])
def test_bad_deepspeed_config(tiny_model, tiny_data, tmp_path, name, text, extra, message):
    """In this process (usage errors in a fresh one: test_bad_input.py)."""
    config = tmp_path / "ds.json"
    if text is not None:
        config.write_text(text)
    output_dir = tmp_path / "out"
    status, _, stderr = run_in_process("train_multigpu.py", training_flags(
        tiny_model, tiny_data, output_dir, "--per_device_train_batch_size", "2", "--deepspeed", config, *extra))
    assert status == 2, stderr[-3000:]
    assert message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert not output_dir.exists()


def test_an_untested_deepspeed_is_refused(tiny_model, tiny_data, tmp_path, monkeypatch):
    """alpaca.zero reads private parts of DeepSpeed's ZeRO optimizers, checked with the version
    requirements.txt pins: another one is refused in one line, before anything is written."""
    from alpaca.deepspeed_config import TESTED_DEEPSPEED

    assert f"deepspeed=={TESTED_DEEPSPEED}\n" in (REPO / "requirements.txt").read_text()
    monkeypatch.setattr("alpaca.deepspeed_config.version", lambda name: "0.20.0")
    status, _, stderr = run_in_process("train_multigpu.py", [
        "--model_name_or_path", tiny_model, "--data_path", tiny_data, "--output_dir", tmp_path / "out",
        "--deepspeed", ZERO2])
    assert status == 2, stderr[-3000:]
    assert (f"DeepSpeed 0.20.0 is installed, and these scripts are tested with DeepSpeed {TESTED_DEEPSPEED} only"
            in stderr and len(stderr.strip().splitlines()) == 1), stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.fast
@pytest.mark.parametrize("weight_trains", [False, True])
def test_zero3_linear_keeps_the_input_only_for_a_weight_gradient(weight_trains):
    """ZeRO-3's linear (alpaca.zero.frozen_weight_linear, in place of DeepSpeed's): a frozen base's
    linear saves no input for the backward, one that trains does; the gradients are torch's linear's."""
    from alpaca.zero import frozen_weight_linear

    torch.manual_seed(0)
    inputs = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 8, dtype=torch.float64, requires_grad=weight_trains)
    bias = torch.randn(3, dtype=torch.float64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.data_ptr()) or t, lambda t: t):
        frozen_weight_linear()(inputs, weight, bias).square().sum().backward()
    assert (inputs.data_ptr() in saved) == weight_trains, saved
    expected = [tensor.detach().clone().requires_grad_(tensor.requires_grad) for tensor in (inputs, weight)]
    torch.nn.functional.linear(*expected, bias).square().sum().backward()
    assert torch.allclose(inputs.grad, expected[0].grad, rtol=FLOAT64_RTOL)
    if weight_trains:
        assert torch.allclose(weight.grad, expected[1].grad, rtol=FLOAT64_RTOL)


def test_each_rank_owns_its_partition_without_the_padding():
    """A ZeRO-3 parameter of 5 elements on 3 ranks: partitions of 2, the last padded with an element DeepSpeed
    leaves uninitialized (NaN here). The ranks' own elements, in rank order, are the parameter, each once."""
    whole = torch.arange(1.0, 6.0)
    padded = torch.cat([whole, torch.tensor([torch.nan])])
    owned = []
    for rank in range(3):
        parameter = torch.nn.Parameter(torch.empty(0))  # between forwards, no elements of its own
        parameter.ds_numel, parameter.ds_zero_partition_rank = whole.numel(), rank
        parameter.ds_tensor = padded[2 * rank:2 * rank + 2].clone()
        parameter.ds_tensor.ds_numel = 2
        owned.append(own_partition(parameter))
    assert torch.equal(torch.cat(owned), whole)
