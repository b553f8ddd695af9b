"""Evaluation: the eval loss is the per-token loss of the held-out set under the current interventions,
and 1 process, N DDP ranks and N FSDP ranks report the same number."""

import json

import pytest
import torch
import torch.nn.functional as F
from conftest import eval_losses, run_script

from alpaca.args import parse_position
from alpaca.data import eval_batches, format_prompt, intervention_locations, load_splits
from alpaca.model import load_base_model
from alpaca.output import load_reft_model, read_metrics


def eval_records(directory) -> list[dict]:
    return [record for record in read_metrics(directory) if "eval_loss" in record]


def test_evaluates_at_eval_steps_and_after_the_last_step(runs):
    root, _ = runs
    records = eval_records(root / "single")
    assert [record["step"] for record in records] == [4, 8, 9]
    assert all(record["eval_examples"] == 5 and record["eval_label_tokens"] > 0 for record in records)
    assert len({record["eval_loss"] for record in records}) == 3  # the interventions changed between them


def test_two_ranks_report_the_eval_loss_of_one_process(runs):
    """5 eval examples in batches of 2 on 2 ranks: rank 0 evaluates 2 batches, rank 1 one."""
    root, _ = runs
    single, ddp = eval_losses(root / "single"), eval_losses(root / "ddp")
    assert single.keys() == ddp.keys() == {4, 8, 9}
    for step in single:
        assert abs(ddp[step] - single[step]) <= 1e-5, step


def test_eval_loss_is_the_token_loss_of_the_saved_interventions(runs, tiny_model, tiny_eval_data):
    """Recomputed here one example at a time from the saved output, loaded the way a user loads it."""
    root, _ = runs
    model, tokenizer = load_base_model(str(tiny_model), torch.float32, torch.device("cpu"))
    reft_model = load_reft_model(root / "single", model)
    position = parse_position(json.loads((root / "single" / "training_args.json").read_text())["position"])
    loss_sum, label_tokens = 0.0, 0
    for record in json.loads(tiny_eval_data.read_text()):
        prompt = tokenizer(format_prompt(record["instruction"], record["input"]))["input_ids"]
        output = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids = torch.tensor([prompt + output])
        locations = intervention_locations([len(prompt)], position, False, 2, pad_position=None)
        with torch.no_grad():
            _, outputs = reft_model({"input_ids": ids}, unit_locations={"sources->base": (None, locations)})
        logits = outputs.logits[0, len(prompt) - 1 : -1]
        loss_sum += F.cross_entropy(logits, ids[0, len(prompt) :], reduction="sum").item()
        label_tokens += len(output)
    final = eval_records(root / "single")[-1]
    assert final["eval_label_tokens"] == label_tokens
    assert final["eval_loss"] == pytest.approx(loss_sum / label_tokens, abs=1e-5)


def test_eval_split_ratio_holds_out_part_of_the_training_data(tiny_model, tiny_data, tmp_path):
    """21 examples, ratio 0.25: 6 held out, 15 trained on; evaluated at each epoch's end by default."""
    result = run_script(["train.py", "--model_name_or_path", str(tiny_model), "--data_path", str(tiny_data),
                         "--output_dir", str(tmp_path), "--layers", "1;3", "--num_sample_answers", "0",
                         "--per_device_train_batch_size", "4", "--num_train_epochs", "2", "--eval_split_ratio",
                         "0.25"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "15 examples" in result.stdout and "eval: 6 examples, epoch" in result.stdout
    records = eval_records(tmp_path)
    assert [(record["step"], record["eval_examples"]) for record in records] == [(4, 6), (8, 6)]
    assert f"step 4: eval loss {records[0]['eval_loss']:.4f} on 6 examples" in result.stdout
    assert f"eval loss {records[0]['eval_loss']:.4f} -> {records[-1]['eval_loss']:.4f}" in result.stdout


def test_held_out_split_is_seeded_disjoint_and_never_subsampled_into(tiny_data):
    train, held_out = load_splits(str(tiny_data), eval_split_ratio=0.25, max_n_train_example=10, seed=1)
    again, held_out_again = load_splits(str(tiny_data), eval_split_ratio=0.25, max_n_train_example=10, seed=1)
    _, other = load_splits(str(tiny_data), eval_split_ratio=0.25, seed=2)
    assert (len(train), len(held_out)) == (10, 6)
    assert train["instruction"] == again["instruction"] and held_out["instruction"] == held_out_again["instruction"]
    assert held_out["instruction"] != other["instruction"]
    assert not set(train["instruction"]) & set(held_out["instruction"])


def test_eval_batches_cover_every_example_once_longest_first():
    lengths = torch.randint(3, 50, (11,)).numpy()
    batches = eval_batches(lengths, 4)
    assert [len(batch) for batch in batches] == [4, 4, 3]
    assert sorted(i for batch in batches for i in batch) == list(range(11))
    flat = [lengths[i] for batch in batches for i in batch]
    assert flat == sorted(flat, reverse=True)
