"""Prompts, tokenization, masking, intervention positions, the global batch plan."""

import json

import numpy as np
import pytest
import torch
from conftest import build_tiny_model

from alpaca.args import UsageError
from alpaca.data import (
    IGNORE_INDEX,
    Collator,
    format_prompt,
    global_batches,
    intervention_locations,
    load_records,
    load_splits,
    prompt_windows,
    rank_micro_batches,
    tokenize,
)
from alpaca.model import load_base_model


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_base_model(str(tiny_model), torch.float32, torch.device("cpu"))[1]


def test_alpaca_templates():
    assert format_prompt("Add 2 and 3.") == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the "
        "request.\n\n### Instruction:\nAdd 2 and 3.\n\n### Response:\n")
    assert format_prompt("Translate.", "Bonjour") == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n### Instruction:\nTranslate.\n\n"
        "### Input:\nBonjour\n\n### Response:\n")


def test_labels_are_output_plus_eos_with_prompt_masked(tokenizer, tiny_data):
    dataset = tokenize(load_records(str(tiny_data)), tokenizer, 512)
    records = json.loads(tiny_data.read_text())
    assert {bool(record["input"]) for record in records} == {True, False}  # both templates
    for record, example in zip(records, dataset):
        prompt_ids = tokenizer(format_prompt(record["instruction"], record["input"]))["input_ids"]
        output_ids = tokenizer(record["output"], add_special_tokens=False)["input_ids"]
        assert example["prompt_length"] == len(prompt_ids)
        assert example["input_ids"] == prompt_ids + output_ids + [tokenizer.eos_token_id]
    batch = Collator(tokenizer.pad_token_id, (1, 1), False, 4)([dataset[0], dataset[1]])
    for row, example in enumerate([dataset[0], dataset[1]]):
        length, prompt = len(example["input_ids"]), example["prompt_length"]
        assert (batch["labels"][row, :prompt] == IGNORE_INDEX).all()
        assert batch["labels"][row, prompt:length].tolist() == example["input_ids"][prompt:]
        assert (batch["labels"][row, length:] == IGNORE_INDEX).all()
        assert batch["attention_mask"][row].sum() == length
    assert batch["num_label_tokens"] == sum(len(e["input_ids"]) - e["prompt_length"] for e in (dataset[0], dataset[1]))


def test_truncation_keeps_the_prompt_and_drops_examples_without_output(tokenizer, tiny_data):
    lengths = [e["prompt_length"] for e in tokenize(load_records(str(tiny_data)), tokenizer, 512)]
    limit = sorted(lengths)[len(lengths) // 2] + 1  # about half the prompts leave room for one output token
    truncated = tokenize(load_records(str(tiny_data)), tokenizer, limit)
    assert 0 < len(truncated) < len(lengths)
    assert all(len(e["input_ids"]) <= limit and len(e["input_ids"]) > e["prompt_length"] for e in truncated)
    with pytest.raises(UsageError, match="model_max_length"):
        tokenize(load_records(str(tiny_data)), tokenizer, min(lengths))


def test_max_n_train_example_is_a_seeded_subset(tiny_data):
    def subset(seed):
        return load_splits(str(tiny_data), max_n_train_example=5, seed=seed)[0]["instruction"]

    assert subset(1) == subset(1) and subset(1) != subset(2) and len(subset(1)) == 5


def test_positions_first_last_and_both():
    assert prompt_windows(10, 1, 0) == ([0], [])
    assert prompt_windows(10, 0, 1) == ([], [9])  # l1 is the last prompt token
    assert prompt_windows(10, 2, 3) == ([0, 1], [7, 8, 9])
    # f+l without sharing: first half of the interventions on the first window, second half on the last.
    assert intervention_locations([10], (2, 3), False, 2, pad_position=99) == [
        [[0, 1]], [[0, 1]], [[7, 8, 9]], [[7, 8, 9]]]
    # shared weights: one intervention per layer over both windows.
    assert intervention_locations([10], (2, 3), True, 2, pad_position=99) == [[[0, 1, 7, 8, 9]]] * 2


def test_short_prompts_shrink_windows_without_overlap_and_pad_with_the_noop_column():
    assert prompt_windows(3, 2, 2) == ([0], [1, 2])
    assert prompt_windows(1, 1, 1) == ([], [0])
    assert prompt_windows(2, 5, 0) == ([0, 1], [])
    locations = intervention_locations([3, 10], (2, 2), False, 1, pad_position=11)
    assert locations == [[[0, 11], [0, 1]], [[1, 2], [8, 9]]]


def test_pad_token_fallback(tmp_path):
    unk_only = build_tiny_model(tmp_path / "unk", pad_token=False, unk_token=True)
    tokenizer = load_base_model(str(unk_only), torch.float32, torch.device("cpu"))[1]
    assert tokenizer.pad_token == "<unk>"
    eos_only = build_tiny_model(tmp_path / "eos", pad_token=False, unk_token=False)
    tokenizer = load_base_model(str(eos_only), torch.float32, torch.device("cpu"))[1]
    assert tokenizer.pad_token == tokenizer.eos_token == "</s>"


def test_global_batch_plan_is_deterministic_and_reshuffled_each_epoch():
    epoch0 = global_batches(23, 8, seed=3, epoch=0)
    assert epoch0 == global_batches(23, 8, seed=3, epoch=0)
    assert [len(b) for b in epoch0] == [8, 8, 7]
    assert sorted(i for b in epoch0 for i in b) == list(range(23))
    assert epoch0 != global_batches(23, 8, seed=3, epoch=1)
    assert epoch0 != global_batches(23, 8, seed=4, epoch=0)


@pytest.mark.parametrize("world_size,per_device,accumulation", [(1, 2, 4), (2, 2, 2), (4, 1, 2), (2, 4, 1)])
def test_micro_batches_partition_each_global_batch(world_size, per_device, accumulation):
    for global_batch in global_batches(21, world_size * per_device * accumulation, seed=0, epoch=0):
        shards = [rank_micro_batches(global_batch, rank, world_size, per_device, accumulation)
                  for rank in range(world_size)]
        assert all(len(shard) == accumulation for shard in shards)
        assert all(len(micro) <= per_device for shard in shards for micro in shard)
        seen = [i for shard in shards for micro in shard for i in micro]
        assert sorted(seen) == sorted(global_batch)


def test_length_grouping_keeps_the_plan_exact_and_cuts_padding():
    lengths = np.random.default_rng(0).integers(20, 500, size=1003)
    grouped = global_batches(1003, 8, seed=5, epoch=0, lengths=lengths)
    assert grouped == global_batches(1003, 8, seed=5, epoch=0, lengths=lengths)
    assert grouped != global_batches(1003, 8, seed=5, epoch=1, lengths=lengths)
    assert sorted(i for batch in grouped for i in batch) == list(range(1003))
    assert sorted(len(batch) for batch in grouped)[1:] == [8] * 125  # one partial batch of 3

    def padded(batches):  # tokens computed when each batch is padded to its longest example
        return sum(len(batch) * lengths[batch].max() for batch in batches)

    random_batches = global_batches(1003, 8, seed=5, epoch=0)
    assert padded(grouped) < 0.65 * padded(random_batches)
