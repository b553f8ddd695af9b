"""Prompts, tokenization, masking, intervention positions, the global batch plan."""

import copy
import json

import numpy as np
import pytest
import torch
from conftest import build_tiny_model, scripts_tokenizer, with_chat_template
from torch.utils.data import DataLoader

from alpaca.collate import IGNORE_INDEX, Collator, StepCollator, first_and_last_positions, intervention_locations, packs
from alpaca.data import (
    _dataset_fingerprint,
    format_prompt,
    load_records,
    load_splits,
    prepare_dataset,
    render_prompt,
    tokenize,
)
from alpaca.errors import UsageError
from alpaca.sampler import DistributedGlobalBatchSampler, dataloader_worker_init, global_batches, rank_micro_batches

pytestmark = pytest.mark.fast  # unit tests, all in `make test-fast`


def step_loader(dataset, collate: Collator, args, pin_memory: bool, num_replicas: int = 1, rank: int = 0):
    """The training DataLoader as the scripts build it: one item per optimizer step, this rank's micro-batches."""
    lengths = np.array(dataset["length"])
    sampler = DistributedGlobalBatchSampler(
        len(dataset), args.per_device_train_batch_size, args.gradient_accumulation_steps, num_replicas=num_replicas,
        rank=rank, seed=args.seed, lengths=lengths if args.group_by_length else None,
        packing=(lengths, args.packing_max_tokens) if args.packing_max_tokens else None)
    return DataLoader(dataset, batch_sampler=sampler, pin_memory=pin_memory,
                      collate_fn=StepCollator(collate, args.per_device_train_batch_size, args.packing_max_tokens),
                      num_workers=args.dataloader_num_workers, persistent_workers=False,
                      worker_init_fn=dataloader_worker_init, generator=torch.Generator())


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
    assert first_and_last_positions(10, 1, 0) == ([0], [])
    assert first_and_last_positions(10, 0, 1) == ([], [9])  # l1 is the last prompt token
    assert first_and_last_positions(10, 2, 3) == ([0, 1], [7, 8, 9])
    # f+l without sharing: first half of the interventions on the first positions, second half on the last.
    assert intervention_locations([10], (2, 3), False, 2, pad_position=99) == [
        [[0, 1]], [[0, 1]], [[7, 8, 9]], [[7, 8, 9]]]
    # shared weights: one intervention per layer over first and last positions.
    assert intervention_locations([10], (2, 3), True, 2, pad_position=99) == [[[0, 1, 7, 8, 9]]] * 2


def test_short_prompts_shrink_first_and_last_positions_without_overlap_and_pad_with_the_noop_column():
    assert first_and_last_positions(3, 2, 2) == ([0], [1, 2])
    assert first_and_last_positions(1, 1, 1) == ([], [0])
    assert first_and_last_positions(2, 5, 0) == ([0, 1], [])
    locations = intervention_locations([3, 10], (2, 2), False, 1, pad_position=11)
    assert locations == [[[0, 11], [0, 1]], [[1, 2], [8, 9]]]


def test_pad_token_fallback(tmp_path):
    unk_only = build_tiny_model(tmp_path / "unk", pad_token=False, unk_token=True)
    tokenizer = scripts_tokenizer(unk_only)
    assert tokenizer.pad_token == "<unk>"
    eos_only = build_tiny_model(tmp_path / "eos", pad_token=False, unk_token=False)
    tokenizer = scripts_tokenizer(eos_only)
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


@pytest.mark.parametrize("world_size,per_device,accumulation", [(1, 2, 4), (2, 2, 2), (4, 1, 2), (2, 4, 1), (4, 2, 2)])
@pytest.mark.parametrize("grouped", [False, True])
def test_sampler_yields_each_ranks_micro_batches_of_the_plan(world_size, per_device, accumulation, grouped):
    """One item per global batch on every rank, even for an empty share; StepCollator cuts it back into the
    rank's micro-batches; the ranks' items partition the global batch; a new order each epoch."""
    lengths = np.random.default_rng(1).integers(5, 90, size=21) if grouped else None
    global_batch_size = world_size * per_device * accumulation
    samplers = [DistributedGlobalBatchSampler(21, per_device, accumulation, num_replicas=world_size, rank=rank, seed=7,
                                   lengths=lengths) for rank in range(world_size)]
    cut = StepCollator(collate=lambda examples: examples, per_device_batch_size=per_device)
    orders = []
    for epoch in range(2):
        plan = global_batches(21, global_batch_size, seed=7, epoch=epoch, lengths=lengths)
        items = []
        for sampler in samplers:
            sampler.set_epoch(epoch)
            items.append(list(sampler))
            assert len(sampler) == len(items[-1]) == len(plan)
        for index, global_batch in enumerate(plan):
            for rank in range(world_size):
                expected = rank_micro_batches(global_batch, rank, world_size, per_device, accumulation)
                assert cut(items[rank][index]) == [micro for micro in expected if micro]
            assert sorted(i for rank_items in items for i in rank_items[index]) == sorted(global_batch)
        orders.append(items)
    assert orders[0] != orders[1]
    if global_batch_size == 16:  # 21 examples: the partial global batch leaves some rank an empty share
        assert any(not item for rank_items in orders[0] for item in rank_items)


@pytest.mark.parametrize("world_size,per_device,accumulation", [(1, 4, 2), (2, 2, 2)])
def test_packed_steps_have_no_padding_and_every_rank_runs_the_same_forwards(tokenizer, tiny_data, world_size,
                                                                            per_device, accumulation):
    """--packing, --group_by_length false: each rank's share of each global batch cut into packs of at most the
    budget, in order, with no padding (0 %); every example of the epoch trained on once; `micro_steps` is the
    most packs of any rank, the forwards a sharded strategy needs every rank to run."""
    import argparse

    dataset = tokenize(load_records(str(tiny_data)), tokenizer, 512)
    collate = Collator(tokenizer.pad_token_id, (1, 1), False, 4)
    budget = 3 * max(dataset["length"])
    args = argparse.Namespace(per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
                              seed=1, group_by_length=False, dataloader_num_workers=0, packing_max_tokens=budget)
    loaders = [step_loader(dataset, collate, args, False, world_size, rank) for rank in range(world_size)]
    steps = list(zip(*loaders))
    micro_steps = [loaders[0].batch_sampler.micro_steps(index) for index in range(len(steps))]
    packed = [pack for shares in steps for share in shares for pack in share]
    assert all(pack["input_ids"].shape == (1, pack["num_tokens"]) for pack in packed)  # 0 % padding
    assert all(pack["num_tokens"] <= budget for pack in packed)
    assert sum(pack["num_tokens"] for pack in packed) == sum(dataset["length"])
    assert max(len(pack["intervention_locations"][0][0]) for pack in packed) > 2  # several examples a pack
    assert micro_steps == [max(len(share) for share in shares) for shares in steps]
    assert packs([5, 5, 3, 9, 1], 10) == [[0, 1], [2], [3, 4]]


def test_sampler_resumes_at_a_global_batch():
    sampler = DistributedGlobalBatchSampler(21, 2, 2, num_replicas=2, rank=1, seed=3)
    sampler.set_epoch(4)
    whole = list(sampler)
    sampler.set_start(2)
    assert list(sampler) == whole[2:] and len(sampler) == len(whole) - 2
    sampler.set_start(len(whole))  # saved at the end of an epoch: nothing left in it
    assert list(sampler) == [] and len(sampler) == 0


def test_sampler_without_shuffle_keeps_the_dataset_order():
    sampler = DistributedGlobalBatchSampler(7, 2, 1, num_replicas=2, rank=0, shuffle=False)
    assert list(sampler) == [[0, 1], [4, 5]]
    with pytest.raises(ValueError, match="rank 2"):
        DistributedGlobalBatchSampler(7, 2, 1, num_replicas=2, rank=2)


def test_pad_to_multiple_of_rounds_the_width_up_and_changes_no_label(tokenizer, tiny_data):
    dataset = tokenize(load_records(str(tiny_data)), tokenizer, 512)
    examples = [dataset[i] for i in range(3)]
    plain = Collator(tokenizer.pad_token_id, (1, 1), False, 4)(examples)
    rounded = Collator(tokenizer.pad_token_id, (1, 1), False, 4, pad_to_multiple_of=16)(examples)
    width = plain["input_ids"].shape[1]
    assert rounded["input_ids"].shape[1] == -(-width // 16) * 16 > width
    assert torch.equal(rounded["labels"][:, :width], plain["labels"])
    assert (rounded["labels"][:, width:] == IGNORE_INDEX).all() and (rounded["attention_mask"][:, width:] == 0).all()
    assert rounded["num_label_tokens"] == plain["num_label_tokens"]
    assert rounded["num_tokens"] == plain["num_tokens"] == int(plain["attention_mask"].sum())


def test_dataloader_workers_give_the_same_steps_survive_a_stop_signal_and_end_with_the_loop(tokenizer, tiny_data):
    """What the scripts build (step_loader): 2 workers give the batches collated in-process, epoch after epoch.
    SIGTERM to a worker (a cluster signals every process) leaves it running: the main process decides. A loop
    left early (the last step) ends the workers at once, not at the DataLoader's garbage collection, which
    can come too late for them to hear it (a hang at exit)."""
    import argparse
    import os
    import signal
    import time

    from test_resume import child_pids

    dataset = tokenize(load_records(str(tiny_data)), tokenizer, 512)
    collate = Collator(tokenizer.pad_token_id, (1, 1), False, 4, pad_to_multiple_of=8)

    def steps(num_workers):
        args = argparse.Namespace(per_device_train_batch_size=2, gradient_accumulation_steps=2, seed=1,
                                  group_by_length=True, dataloader_num_workers=num_workers, packing_max_tokens=None)
        loader = step_loader(dataset, collate, args, pin_memory=False)
        sampler = loader.batch_sampler
        seen = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for index, micro_batches in enumerate(loader):
                if num_workers and epoch == 0 and index == 0:
                    workers = child_pids(os.getpid())
                    assert len(workers) == num_workers
                    os.kill(workers[0], signal.SIGTERM)
                seen.append(micro_batches)
                if epoch == 2 and index == 2:
                    break
        deadline = time.monotonic() + 30
        while child_pids(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert child_pids(os.getpid()) == [], "DataLoader workers outlived the loop that used them"
        return seen

    in_process, in_workers = steps(0), steps(2)
    assert len(in_process) == len(in_workers) == 2 * 6 + 3  # 21 examples, global batch 4

    def same(a, b) -> bool:
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(same(a[key], b[key]) for key in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return torch.equal(a, b) if torch.is_tensor(a) else a == b

    assert same(in_process, in_workers)


def test_chat_template_makes_the_record_a_user_and_an_assistant_turn(chat_tokenizer, tiny_data):
    """Instruction (+ input) is the user turn; the rendered prompt is tokenized as is (the template's BOS only);
    the labels are the output's tokens and EOS, as with the Alpaca prompt; l1 is the prompt's last token."""
    tokenizer = chat_tokenizer
    dataset = tokenize(load_records(str(tiny_data)), tokenizer, 512, "chat")
    records = json.loads(tiny_data.read_text())
    assert {bool(record["input"]) for record in records} == {True, False}
    for record, example in zip(records, dataset):
        user = record["instruction"] + (f"\n\n{record['input']}" if record["input"] else "")
        prompt = f"<s><|im_start|>user\n{user}</s>\n<|im_start|>assistant\n"
        assert render_prompt(tokenizer, record["instruction"], record["input"], "chat") == prompt
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert prompt_ids.count(tokenizer.bos_token_id) == 1 and prompt_ids[0] == tokenizer.bos_token_id
        output_ids = tokenizer(record["output"], add_special_tokens=False)["input_ids"]
        assert example["prompt_length"] == len(prompt_ids)
        assert example["input_ids"] == prompt_ids + output_ids + [tokenizer.eos_token_id]
        _, last = first_and_last_positions(example["prompt_length"], 2, 2)
        assert example["input_ids"][last[-1]] == prompt_ids[-1]
    batch = Collator(tokenizer.pad_token_id, (2, 2), False, 4)([dataset[0], dataset[1]])
    for row, example in enumerate([dataset[0], dataset[1]]):
        prompt = example["prompt_length"]
        assert (batch["labels"][row, :prompt] == IGNORE_INDEX).all()
        assert batch["labels"][row, prompt : len(example["input_ids"])].tolist() == example["input_ids"][prompt:]


def test_a_chat_template_whose_conversation_does_not_extend_its_prompt_is_refused(tiny_model, tiny_data, tmp_path):
    model = with_chat_template(tiny_model, tmp_path / "model", "{% for message in messages %}{{ message['role'] }}: "
                               "{{ message['content'] }}\n{% endfor %}{% if add_generation_prompt %}AI:{% endif %}")
    tokenizer = scripts_tokenizer(model)
    with pytest.raises(UsageError, match="does not start with its own generation prompt"):
        tokenize(load_records(str(tiny_data)), tokenizer, 512, "chat")


def test_the_tokenization_cache_tells_prompt_templates_apart(chat_tokenizer, tiny_data, tmp_path):
    """Alpaca and chat tokenizations of the same records are cached apart, and so are two chat templates."""
    records = load_records(str(tiny_data))
    alpaca = prepare_dataset(records, chat_tokenizer, 512, str(tmp_path), "alpaca")
    chat = prepare_dataset(records, chat_tokenizer, 512, str(tmp_path), "chat")
    assert alpaca["input_ids"] == tokenize(records, chat_tokenizer, 512)["input_ids"]
    assert chat["input_ids"] == tokenize(records, chat_tokenizer, 512, "chat")["input_ids"] != alpaca["input_ids"]
    other = copy.deepcopy(chat_tokenizer)
    other.chat_template = chat_tokenizer.chat_template.replace("<|im_start|>", "<|turn|>")
    assert (_dataset_fingerprint(records, other, 512, "chat")
            != _dataset_fingerprint(records, chat_tokenizer, 512, "chat"))
    assert (_dataset_fingerprint(records, other, 512, "alpaca")
            == _dataset_fingerprint(records, chat_tokenizer, 512, "alpaca"))
