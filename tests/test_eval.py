"""Evaluation: the eval loss is the per-token loss of the held-out set under the current interventions,
and 1 process, N DDP ranks and N FSDP ranks report the same number."""

import json

import pytest
import torch
from conftest import assert_reproduces_eval_loss, eval_losses, rounding_tolerances, run_in_process, training_flags

from alpaca.data import load_splits
from alpaca.output import read_metrics
from alpaca.sampler import eval_batches


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
    assert ddp == pytest.approx(single, rel=rounding_tolerances(root / "single")["eval_loss"], abs=0)


def test_eval_loss_is_the_token_loss_of_the_saved_interventions(runs, tiny_tied_model, tiny_eval_data):
    """Recomputed here one example at a time from the saved output, loaded the way a user loads it."""
    root, _ = runs
    final = eval_records(root / "single")[-1]
    records = json.loads(tiny_eval_data.read_text())
    assert {bool(record["input"]) for record in records} == {True, False}  # both prompt templates
    assert_reproduces_eval_loss(final["eval_loss"], root / "single", tiny_tied_model, records)


@pytest.mark.parametrize("name", ["single", "ddp"])
def test_evaluation_switches_dropout_off(reference, tiny_model, tiny_data, name):
    """The reference runs train with dropout 0.1 on the intervention output: the eval loss they logged after
    their last step is that of the saved interventions without dropout (with it, it would be far off)."""
    final = eval_records(reference / name)[-1]
    assert final["step"] == 9 and json.loads((reference / name / "training_args.json").read_text())["dropout"] > 0
    _, held_out = load_splits(str(tiny_data), eval_split_ratio=0.15, seed=42)
    assert final["eval_examples"] == len(held_out) == 4
    assert_reproduces_eval_loss(final["eval_loss"], reference / name, tiny_model, held_out)


def test_eval_split_ratio_holds_out_part_of_the_training_data(tiny_model, tiny_data, tmp_path):
    """21 examples, ratio 0.25: 6 held out, 15 trained on; evaluated at each epoch's end by default."""
    status, stdout, stderr = run_in_process("train.py", training_flags(
        tiny_model, tiny_data, tmp_path, "--num_sample_answers", "0", "--per_device_train_batch_size", "4",
        "--num_train_epochs", "2", "--eval_split_ratio", "0.25"))
    assert status == 0, stderr[-3000:]
    assert "15 examples" in stdout and "eval: 6 examples, epoch" in stdout
    records = eval_records(tmp_path)
    assert [(record["step"], record["eval_examples"]) for record in records] == [(4, 6), (8, 6)]
    assert f"step 4: eval loss {records[0]['eval_loss']:.4f} on 6 examples" in stdout
    assert f"eval loss {records[0]['eval_loss']:.4f} -> {records[-1]['eval_loss']:.4f}" in stdout


@pytest.mark.fast
def test_held_out_split_is_seeded_disjoint_and_never_subsampled_into(tiny_data):
    train, held_out = load_splits(str(tiny_data), eval_split_ratio=0.25, max_n_train_example=10, seed=1)
    again, held_out_again = load_splits(str(tiny_data), eval_split_ratio=0.25, max_n_train_example=10, seed=1)
    _, other = load_splits(str(tiny_data), eval_split_ratio=0.25, seed=2)
    assert (len(train), len(held_out)) == (10, 6)
    assert train["instruction"] == again["instruction"] and held_out["instruction"] == held_out_again["instruction"]
    assert held_out["instruction"] != other["instruction"]
    assert not set(train["instruction"]) & set(held_out["instruction"])


@pytest.mark.fast
def test_eval_batches_cover_every_example_once_longest_first():
    lengths = torch.randint(3, 50, (11,)).numpy()
    batches = eval_batches(lengths, 4)
    assert [len(batch) for batch in batches] == [4, 4, 3]
    assert sorted(i for batch in batches for i in batch) == list(range(11))
    flat = [lengths[i] for batch in batches for i in batch]
    assert flat == sorted(flat, reverse=True)
