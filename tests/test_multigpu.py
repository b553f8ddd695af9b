"""train_multigpu.py under torchrun (gloo, CPU): N processes train exactly the model one process trains."""

import json

import pytest
import torch
from conftest import (
    COMMON,
    FAULTS,
    LAYERS,
    assert_same_run,
    copy_as_killed,
    intervention_weights,
    run_in_process,
    threads_left,
    torchrun,
    training_flags,
)

from alpaca.output import read_metrics
from alpaca.sampler import global_batches, rank_micro_batches


@pytest.mark.fast
def test_two_ranks_train_the_same_model_as_train_py(runs):
    root, _ = runs
    assert [r["step"] for r in read_metrics(root / "ddp") if "loss" in r] == list(range(1, 10))  # 3 epochs x 3
    assert_same_run(root / "ddp", root / "single")


def test_world_size_one_is_train_py_bit_for_bit(runs):
    """One process of train_multigpu.py does train.py's arithmetic: the same run exactly (and so, within float
    noise, the two-rank one)."""
    root, data = runs
    status, _, stderr = run_in_process("train_multigpu.py", [*data, "--output_dir", root / "one",
                                                             "--per_device_train_batch_size", "2",
                                                             "--gradient_accumulation_steps", "4"])
    assert status == 0, stderr[-3000:]
    assert_same_run(root / "one", root / "single", exact=True)


def test_dataloader_workers_rounded_padding_and_gradient_checkpointing_train_the_same_model(runs):
    """Batches collated in 2 worker processes per rank and padded to a multiple of 16, with
    --gradient_checkpointing under DDP: the same steps, within float noise (the padded shapes sum in another
    order; under FSDP: test_fsdp.py's resume). Through tests/faults.py without a fault: the finished ranks
    leave no process-group thread."""
    root, data = runs
    result = torchrun(2, [FAULTS, "train_multigpu.py", *data, "--output_dir", str(root / "workers"),
                          "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                          "--dataloader_num_workers", "2", "--pad_to_multiple_of", "16", "--gradient_checkpointing"])
    assert result.returncode == 0, result.stderr[-3000:]
    args = json.loads((root / "workers" / "training_args.json").read_text())
    assert (args["pad_to_multiple_of"], args["gradient_checkpointing"]) == (16, True)
    assert_same_run(root / "workers", root / "ddp")
    assert threads_left(result.stderr) == ["[]", "[]"], result.stderr[-3000:]


def test_compiled_layers_train_the_same_model_in_a_bounded_number_of_graphs(runs):
    """--torch_compile: one process (in this one, to read Dynamo's counters) and two with
    --gradient_checkpointing train the eager runs' model, within float noise. The run has
    a new width at almost every micro-batch (no rounding on the CPU), but the layers compile once per kind of call:
    with or without grad (training, evaluation), an input that needs grad or not (layers before and after the
    first intervention), a batch of one example or more (Dynamo specializes sizes 0 and 1). --fsdp is refused."""
    from torch._dynamo.utils import counters

    root, data = runs
    torch._dynamo.reset()
    counters.clear()
    compiled = ["--per_device_train_batch_size", "2", "--torch_compile"]
    shapes = set()  # of the hidden states entering the decoder layers
    hook = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda module, inputs: shapes.add(inputs[0].shape) if type(module).__name__ == "LlamaDecoderLayer" else None)
    try:
        status, _, stderr = run_in_process("train.py", [*data, "--output_dir", root / "compiled", *compiled,
                                                        "--gradient_accumulation_steps", "4"])
    finally:
        hook.remove()
    assert status == 0, stderr[-3000:]
    graphs = counters["stats"]["unique_graphs"]
    # 8 (the kinds above) is also Dynamo's recompile limit, past which it would run the layers eager
    assert 0 < graphs <= 2 * 2 * 2 <= torch._dynamo.config.recompile_limit, graphs
    assert len(shapes) > graphs, shapes  # 14 shapes, 6 graphs
    assert_same_run(root / "compiled", root / "single")
    result = torchrun(2, ["train_multigpu.py", *data, "--output_dir", str(root / "compiled-ddp"), *compiled,
                          "--gradient_accumulation_steps", "2", "--gradient_checkpointing"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(root / "compiled-ddp", root / "ddp")
    status, _, stderr = run_in_process("train_multigpu.py", [*data, "--output_dir", root / "refused", *compiled,
                                                             "--fsdp"])
    assert status == 2 and "--torch_compile is not yet tested with --fsdp" in stderr, stderr[-3000:]


def test_only_rank_zero_prints_and_writes(runs):
    root, _ = runs
    logs = {path.parent.name + "/" + path.name: path.read_text() for path in (root / "logs").rglob("std*.log")}
    rank0 = [text for name, text in logs.items() if name.startswith("0/") and name.endswith("stdout.log")]
    rank1 = {name: text for name, text in logs.items() if name.startswith("1/")}
    assert len(rank0) == 1 and "global batch 8 = 2 per device x 2 processes x 2 accumulation" in rank0[0]
    assert "Trained to step 9" in rank0[0]
    assert rank1 and all(text == "" for text in rank1.values()), rank1
    written = sorted(path.name for path in (root / "ddp").iterdir())
    assert written == sorted(["config.json", "loss.png", "metrics.jsonl", "run_finished.json", "training_args.json"]
                             + [path.name for path in (root / "single").glob("intkey_*.bin")])
    assert json.loads((root / "ddp" / "training_args.json").read_text())["world_size"] == 2


@pytest.mark.fast
def test_ranks_see_disjoint_shards_covering_each_epoch_in_a_new_order():
    world_size, per_device, accumulation, seed = 2, 2, 2, 42
    orders = []
    for epoch in range(3):
        shards = {rank: [] for rank in range(world_size)}
        for global_batch in global_batches(21, world_size * per_device * accumulation, seed, epoch):
            for rank in range(world_size):
                shards[rank] += [i for micro in rank_micro_batches(global_batch, rank, world_size, per_device,
                                                                   accumulation) for i in micro]
        assert not set(shards[0]) & set(shards[1])
        assert sorted(shards[0] + shards[1]) == list(range(21))
        orders.append(shards[0])
    assert orders[0] != orders[1] != orders[2]


def test_bf16_output_loads_in_pyreft(tiny_model, tiny_data, tmp_path):
    """On a bf16 model pyreft's own loader rebuilds the interventions we trained (not their initial values, which
    the files would also hold if training changed nothing): the rotation exactly, the float32 learned source
    rounded to bf16, where pyreft builds it. One process of train_multigpu.py (2 ranks train in bf16 in
    test_resume.py's stop-signal runs)."""
    import pyreft

    from alpaca.model import build_reft_model, load_base_model

    status, _, stderr = run_in_process("train_multigpu.py", training_flags(tiny_model, tiny_data, tmp_path, *COMMON,
                                                                           "--max_steps", "2", "--dtype", "bfloat16"))
    assert status == 0, stderr[-3000:]
    base, _ = load_base_model(str(tiny_model), torch.bfloat16, torch.device("cpu"))
    reft_model = pyreft.ReftModel.load(str(tmp_path), base)
    saved = intervention_weights(tmp_path)
    fresh, _ = load_base_model(str(tiny_model), torch.bfloat16, torch.device("cpu"))
    torch.manual_seed(42)  # the run's --seed: its initial interventions
    initial = build_reft_model(fresh, LAYERS, (2, 2), False, low_rank_dimension=4).interventions
    for key, intervention in reft_model.interventions.items():
        assert torch.equal(intervention.learned_source.weight, saved[f"intkey_{key}.bin/weight"].bfloat16())
        assert torch.equal(intervention.rotate_layer.weight, saved[f"intkey_{key}.bin/rotate_layer"])
        assert not torch.equal(intervention.learned_source.weight, initial[key].learned_source.weight.bfloat16())
    ids = torch.randint(0, 300, (1, 12))
    locations = [[[0, 1]]] * 2 + [[[10, 11]]] * 2
    _, outputs = reft_model({"input_ids": ids}, unit_locations={"sources->base": (None, locations)})
    assert torch.isfinite(outputs.logits).all()


def test_wandb_offline_gives_one_run_for_all_ranks(fsdp_runs):
    """The two ranks of test_fsdp.py's run (with evaluation) report to wandb offline: one run, from rank 0."""
    root, result = fsdp_runs
    runs = list((root / "fsdp" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    assert "logged offline" in result.stdout and "wandb sync" in result.stdout
    logged = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert b"train/loss" in logged and b"eval/loss" in logged


def test_pyreft_command_line_on_four_processes(pyreft_command_line, pyreft_example_run, tmp_path):
    """The same command line on 4 processes, with the accumulation that keeps its global batch (4 per device x 4
    processes x 2): the model of one process. 21 examples in a global batch of 32: one partial step per
    epoch, of which the ranks hold 6, 5, 5 and 5 examples."""
    result = torchrun(4, ["train_multigpu.py", *pyreft_command_line, "--gradient_accumulation_steps", "2",
                          "--output_dir", str(tmp_path), "--num_sample_answers", "0"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "global batch 32 = 4 per device x 4 processes x 2 accumulation" in result.stdout
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]
    assert_same_run(tmp_path, pyreft_example_run[0])


def test_packed_runs_on_one_and_two_processes_train_the_model_of_the_padded_run(runs):
    """--packing: each rank's share of a global batch (the same plan of 8 examples) cut into packs of at most 512
    tokens (several packs a share); train.py, and 2 ranks under DDP with --gradient_checkpointing,
    train the padded run's model: the same weights, per-step loss, gradient norm and eval loss (evaluated
    padded), within float noise. The packed run resumed from its checkpoint-4 (inside epoch 2) is the
    uninterrupted one exactly."""
    root, data = runs
    packed = [*data, "--output_dir", root / "packed", "--packing", "--packing_max_tokens", "512",
              "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4", "--save_strategy", "steps",
              "--save_steps", "4"]
    status, stdout, stderr = run_in_process("train.py", packed)
    assert status == 0, stderr[-3000:]
    assert "global batch 8 = 2 per device x 4 accumulation, packed into micro-batches of up to 512 tokens" in stdout
    assert_same_run(root / "packed", root / "single")
    copy_as_killed(root / "packed", root / "packed-resumed", 4)
    status, stdout, stderr = run_in_process("train.py", [*packed, "--output_dir", root / "packed-resumed",
                                                         "--resume_from_checkpoint", "auto"])
    assert status == 0 and "at step 4" in stdout, stderr[-3000:]
    assert_same_run(root / "packed-resumed", root / "packed", exact=True)
    result = torchrun(2, ["train_multigpu.py", *data, "--output_dir", str(root / "packed-ddp"), "--packing",
                          "--packing_max_tokens", "512", "--per_device_train_batch_size", "2",
                          "--gradient_accumulation_steps", "2", "--gradient_checkpointing"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(root / "packed-ddp", root / "single")
