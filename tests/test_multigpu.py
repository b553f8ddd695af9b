"""train_multigpu.py under torchrun (gloo, CPU): N processes train exactly the model one process trains."""

import json

import torch
from conftest import COMMON, assert_same_model, intervention_weights, run_script, torchrun

from alpaca.data import global_batches, rank_micro_batches
from alpaca.output import read_metrics


def test_two_ranks_train_the_same_model_as_train_py(runs):
    root, _ = runs
    assert [r["step"] for r in read_metrics(root / "ddp") if "loss" in r] == list(range(1, 10))  # 3 epochs x 3
    assert_same_model(root / "ddp", root / "single")


def test_world_size_one_matches_two(runs):
    root, data = runs
    result = run_script(["train_multigpu.py", *data, "--output_dir", str(root / "one"),
                         "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_model(root / "ddp", root / "one")


def test_dataloader_workers_and_rounded_padding_train_the_same_model(runs):
    """Batches collated in 2 worker processes per rank and padded to a multiple of 16: the same steps."""
    root, data = runs
    result = torchrun(2, ["train_multigpu.py", *data, "--output_dir", str(root / "workers"),
                          "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                          "--dataloader_num_workers", "2", "--pad_to_multiple_of", "16"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((root / "workers" / "training_args.json").read_text())["pad_to_multiple_of"] == 16
    assert_same_model(root / "workers", root / "ddp")


def test_only_rank_zero_prints_and_writes(runs):
    root, _ = runs
    logs = {path.parent.name + "/" + path.name: path.read_text() for path in (root / "logs").rglob("std*.log")}
    rank0 = [text for name, text in logs.items() if name.startswith("0/") and name.endswith("stdout.log")]
    rank1 = {name: text for name, text in logs.items() if name.startswith("1/")}
    assert len(rank0) == 1 and "global batch 8 = 2 per device x 2 processes x 2 accumulation" in rank0[0]
    assert "Trained to step 9" in rank0[0]
    assert rank1 and all(text == "" for text in rank1.values()), rank1
    written = sorted(path.name for path in (root / "ddp").iterdir())
    assert written == sorted(["config.json", "loss.png", "metrics.jsonl", "training_args.json"]
                             + [path.name for path in (root / "single").glob("intkey_*.bin")])
    assert json.loads((root / "ddp" / "training_args.json").read_text())["world_size"] == 2


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
    """On a bf16 model pyreft's own loader rebuilds exactly the interventions we trained."""
    import pyreft

    from alpaca.model import load_base_model

    result = torchrun(2, ["train_multigpu.py", "--model_name_or_path", str(tiny_model), "--data_path",
                          str(tiny_data), *COMMON, "--max_steps", "2", "--dtype", "bfloat16", "--output_dir",
                          str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    base, _ = load_base_model(str(tiny_model), torch.bfloat16, torch.device("cpu"))
    reft_model = pyreft.ReftModel.load(str(tmp_path), base)
    saved = intervention_weights(tmp_path)
    for key, intervention in reft_model.interventions.items():
        assert torch.equal(intervention.learned_source.weight, saved[f"intkey_{key}.bin/weight"])
        assert torch.equal(intervention.rotate_layer.weight, saved[f"intkey_{key}.bin/rotate_layer"])
    ids = torch.randint(0, 300, (1, 12))
    locations = [[[0, 1]]] * 2 + [[[10, 11]]] * 2
    _, outputs = reft_model({"input_ids": ids}, unit_locations={"sources->base": (None, locations)})
    assert torch.isfinite(outputs.logits).all()


def test_pyreft_command_line_on_four_processes(tiny_model, tiny_data, tmp_path):
    """The README's multi-GPU command line, verbatim but for the model and data paths."""
    result = torchrun(4, [
        "train_multigpu.py", "--model_name_or_path", str(tiny_model), "--data_path", str(tiny_data),
        "--output_dir", str(tmp_path), "--layers", "1;3", "--rank", "4", "--position", "f1+l1",
        "--num_train_epochs", "2", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
        "--gradient_accumulation_steps", "8", "--evaluation_strategy", "no", "--save_strategy", "no",
        "--learning_rate", "2e-5", "--weight_decay", "0.", "--warmup_ratio", "0.03", "--lr_scheduler_type",
        "cosine", "--logging_steps", "1", "--max_n_train_example", "10000", "--optim", "adamw_torch",
        "--remove_unused_columns", "False", "--num_sample_answers", "0"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(read_metrics(tmp_path)) == 2  # 21 examples in a global batch of 128: one step per epoch


def test_wandb_offline_gives_one_run_for_all_ranks(tiny_model, tiny_data, tiny_eval_data, tmp_path):
    result = torchrun(2, ["train_multigpu.py", "--model_name_or_path", str(tiny_model), "--data_path", str(tiny_data),
                          *COMMON, "--max_steps", "2", "--report_to", "wandb", "--output_dir", str(tmp_path),
                          "--eval_data_path", str(tiny_eval_data)])
    assert result.returncode == 0, result.stderr[-3000:]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    assert "logged offline" in result.stdout and "wandb sync" in result.stdout
    logged = next(runs[0].glob("run-*.wandb")).read_bytes()
    assert b"train/loss" in logged and b"eval/loss" in logged
