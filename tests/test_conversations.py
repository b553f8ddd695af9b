"""Conversation records ({"messages": [...]}) under --prompt_template chat: labels on every assistant turn and
nothing else, the prompt before the last assistant turn, whole turns kept by truncation, 1 vs 2 processes."""

import json

import pytest
import torch
from conftest import (
    CHAT_TEMPLATE,
    COMMON,
    REPO,
    assert_same_run,
    one_thread,
    run_in_process,
    torchrun,
    training_flags,
    with_chat_template,
)

from alpaca.collate import IGNORE_INDEX, Collator
from alpaca.data import chat_prompt, load_records, tokenize
from alpaca.errors import UsageError

SAMPLE_CONVERSATIONS = REPO / "examples" / "data" / "conversations_sample.jsonl"
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "Red, and green."},
]


collate = Collator(pad_token_id=0, position=(1, 1), share_weights=False, num_layers=2)


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def test_labels_are_every_assistant_turn_through_its_eos_and_nothing_else(chat_tokenizer, tmp_path):
    records = load_records(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]))
    example = tokenize(records, chat_tokenizer, 512, "chat")[0]
    batch = collate([example])
    ids, labels = batch["input_ids"][0], batch["labels"][0]
    eos = chat_tokenizer.eos_token
    assert chat_tokenizer.decode(ids[labels != IGNORE_INDEX]) == f"Blue.{eos}Red, and green.{eos}"
    # the intervened prompt is the whole conversation before the last assistant turn, as generation gets it
    assert chat_tokenizer.decode(ids[: example["prompt_length"]]) == chat_prompt(chat_tokenizer, CONVERSATION[:-1])
    assert batch["num_label_tokens"] == int((labels != IGNORE_INDEX).sum())


def test_a_long_conversation_loses_whole_turns_from_its_end_and_says_so(chat_tokenizer, tmp_path, capsys):
    records = load_records(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]))
    whole = tokenize(records, chat_tokenizer, 512, "chat")[0]["length"]
    first_exchange = tokenize(load_records(write_jsonl(tmp_path / "first.jsonl", [{"messages": CONVERSATION[:3]}])),
                              chat_tokenizer, 512, "chat")[0]
    capsys.readouterr()
    cut = tokenize(records, chat_tokenizer, whole - 1, "chat")[0]
    assert cut["input_ids"] == first_exchange["input_ids"] and cut["label_spans"] == []
    assert "Cut 1 conversation(s) after an earlier assistant turn to fit --model_max_length" in capsys.readouterr().out


def test_an_edited_history_cannot_be_labelled_and_says_so(tiny_model, tmp_path):
    """A template that renders earlier assistant turns otherwise once later ones follow (Qwen3 drops their
    reasoning) leaves no tokens to label for them: one line, not labels on the wrong tokens."""
    from transformers import AutoTokenizer

    editing = CHAT_TEMPLATE.replace("{{ message['content'] }}", "{% if message['role'] == 'assistant' and not "
                                    "loop.last %}(earlier){% else %}{{ message['content'] }}{% endif %}")
    tokenizer = AutoTokenizer.from_pretrained(with_chat_template(tiny_model, tmp_path / "model", editing))
    records = load_records(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]))
    with pytest.raises(UsageError, match="renders an earlier assistant turn differently"):
        tokenize(records, tokenizer, 512, "chat")


@pytest.mark.parametrize("records,message", [
    ([{"messages": CONVERSATION[:2]}], "record 0 of .* ends with a 'user' message; it should end with the assistant"),
    ([{"messages": CONVERSATION}, {"instruction": "a", "output": "b"}], "record 1 of .* has no non-empty 'messages'"),
    ([{"messages": [{"role": "user"}]}], "every message needs a string 'role' and 'content'"),
])
def test_malformed_conversations_are_one_line(records, message, tmp_path):
    with pytest.raises(UsageError, match=message):
        load_records(write_jsonl(tmp_path / "chat.jsonl", records))


@pytest.mark.parametrize("where", ["file", "dataset directory"])
def test_conversations_need_the_chat_template_and_another_field_name_is_mapped(where, chat_tokenizer, tmp_path):
    """From a file, or through datasets.load_dataset as a hub dataset is read (a local directory here)."""
    (tmp_path / "data").mkdir()
    path = write_jsonl(tmp_path / "data" / "chat.jsonl", [{"conversation": CONVERSATION}])
    records = load_records(path if where == "file" else str(tmp_path / "data"), field_map={"conversation": "messages"})
    assert records["messages"] == [CONVERSATION]
    with pytest.raises(UsageError, match="add --prompt_template chat"):
        tokenize(records, chat_tokenizer, 512, "alpaca")
    assert tokenize(records, chat_tokenizer, 512, "chat")[0]["label_spans"] != []


def test_sharegpt_conversations_train_the_same_model_on_1_and_2_processes_and_are_continued(tiny_chat_model,
                                                                                         tmp_path):
    """The shipped sample of conversations (1 to 3 exchanges, some with a system turn), 9 of them in global
    batches of 4, as ShareGPT records (human/gpt/system turns): train.py reads them from JSONL, 2 ranks from
    parquet at once (datasets' cache written by both), and train the same model; generate.py continues a
    conversation with it."""
    import pandas

    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    records = [{"conversations": [{"from": roles[message["role"]], "value": message["content"]}
                                  for message in json.loads(line)["messages"]]}
               for line in SAMPLE_CONVERSATIONS.read_text().splitlines()[:9]]
    pandas.DataFrame(records).to_parquet(tmp_path / "sharegpt.parquet")
    flags = training_flags(tiny_chat_model, None, None, "--prompt_template", "chat", *COMMON, "--num_train_epochs",
                           "2", "--per_device_train_batch_size", "2")
    with one_thread():
        status, _, stderr = run_in_process("train.py", [*flags, "--gradient_accumulation_steps", "2", "--data_path",
                                                        write_jsonl(tmp_path / "sharegpt.jsonl", records),
                                                        "--output_dir", str(tmp_path / "one")])
    assert status == 0, stderr[-3000:]
    result = torchrun(2, ["train_multigpu.py", *flags, "--data_path", str(tmp_path / "sharegpt.parquet"),
                          "--output_dir", str(tmp_path / "two")], env={"HF_DATASETS_CACHE": str(tmp_path / "fresh")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert_same_run(tmp_path / "two", tmp_path / "one")

    prompts = REPO / "examples" / "data" / "conversation_prompts.jsonl"
    status, stdout, stderr = run_in_process("examples/generate.py", ["--reft_dir", str(tmp_path / "one"),
                                                                     "--conversations_file", str(prompts),
                                                                     "--max_new_tokens", "3"])
    assert status == 0, stderr[-3000:]
    assert "(after 2 messages) And for silver?" in stdout


def test_a_conversation_changes_the_loss_through_its_earlier_turns(chat_tokenizer, tmp_path):
    """The earlier assistant turn is in the loss: its labels are counted and lie inside the logits kept."""
    records = load_records(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]))
    example = tokenize(records, chat_tokenizer, 512, "chat")[0]
    batch = collate([example])
    start, _ = example["label_spans"][0]
    assert batch["first_label_position"] == start < example["prompt_length"]
    last_turn_only = collate([{**example, "label_spans": []}])
    assert batch["num_label_tokens"] > last_turn_only["num_label_tokens"]
    assert torch.equal(batch["input_ids"], last_turn_only["input_ids"])


def test_a_pack_labels_each_conversation_as_its_padded_row(chat_tokenizer, tmp_path):
    """--packing: each conversation's labels, earlier assistant turns included, sit in the pack where it starts,
    as in its padded row; its intervened positions are moved there too."""
    records = load_records(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION},
                                                                 {"messages": CONVERSATION[:3]}] * 2))
    examples = list(tokenize(records, chat_tokenizer, 512, "chat"))
    padded, pack = collate(examples), collate.pack(examples)
    start = 0
    for row, example in enumerate(examples):
        length = example["length"]
        assert torch.equal(pack["labels"][0, start : start + length], padded["labels"][row, :length])
        assert torch.equal(pack["position_ids"][0, start : start + length], torch.arange(length))
        firsts = [locations[row][0].item() + start for locations in padded["intervention_locations"]]  # (1, 1)
        assert firsts == [locations[0][row].item() for locations in pack["intervention_locations"]]
        start += length
    assert pack["num_label_tokens"] == padded["num_label_tokens"] and pack["input_ids"].shape == (1, start)
