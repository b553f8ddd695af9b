"""Alpaca data: records (Alpaca's or conversations), prompts, tokenization, intervention positions, the global batch
plan, collation."""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from torch.utils.data import Sampler

from alpaca.args import CONVERSATION_FIELD, RECORD_FIELDS, cache_root
from alpaca.errors import UsageError
from alpaca.manifest import cached_directory

IGNORE_INDEX = -100

# The Stanford Alpaca templates, verbatim.
PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def format_prompt(instruction: str, input: str | None = "") -> str:
    if input:
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return PROMPT_NO_INPUT.format(instruction=instruction)


def user_turn(instruction: str, input: str | None = "") -> dict[str, str]:
    """The chat message of a record (--prompt_template chat): the instruction, then the input if any."""
    return {"role": "user", "content": f"{instruction}\n\n{input}" if input else instruction}


def record_conversation(instruction: str, input: str | None, output: str | None = None) -> list[dict[str, str]]:
    """An Alpaca record as a conversation (--prompt_template chat): its user turn, then the output as the
    assistant's turn (none to generate)."""
    return [user_turn(instruction, input)] + ([{"role": "assistant", "content": output}] if output is not None else [])


def chat_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """A conversation up to the assistant's next turn, rendered by the tokenizer's chat template."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def chat_answer(tokenizer, messages: list[dict[str, str]], prompt: str) -> str:
    """The last (assistant) turn of `messages` as the chat template renders it after `prompt`, the rendering of
    the turns before it, up to and including the first eos: generation stops there, so what follows (ChatML's
    newline) is never generated."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    if not rendered.startswith(prompt):
        raise UsageError("--prompt_template chat: the tokenizer's chat template renders a conversation that does "
                         "not start with its own generation prompt, so answer tokens cannot be told from prompt "
                         "tokens; use --prompt_template alpaca or another chat model")
    answer = rendered[len(prompt) :]
    eos = tokenizer.eos_token
    return answer[: answer.index(eos) + len(eos)] if eos and eos in answer else answer


def render_prompt(tokenizer, instruction: str | list[dict[str, str]], input: str | None, prompt_template: str) -> str:
    """The text before the answer: Alpaca's template, or the tokenizer's chat template up to the assistant turn.
    `instruction` may be a conversation (a list of messages, the last the user's), under the chat template."""
    if prompt_template == "alpaca":
        return format_prompt(instruction, input)
    messages = instruction if isinstance(instruction, list) else record_conversation(instruction, input)
    return chat_prompt(tokenizer, messages)


def conversation_tokens(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int], list[list[int]]]:
    """(prompt ids, answer ids, labelled spans of the prompt) of a conversation that ends with an assistant turn.
    The prompt is every turn before the last assistant turn, tokenized as generation is given it (and where the
    interventions act); the answer is that last turn, through its eos. Each earlier assistant turn is labelled
    too: a [start, end) span of prompt tokens, found from the characters it renders to in the prompt."""
    prompt = chat_prompt(tokenizer, messages[:-1])
    answer_ids = tokenizer(chat_answer(tokenizer, messages, prompt), add_special_tokens=False)["input_ids"]
    if tokenizer.eos_token_id not in answer_ids:  # a template whose turn does not end with eos gets one
        answer_ids.append(tokenizer.eos_token_id)
    earlier_turns = [turn for turn, message in enumerate(messages[:-1]) if message["role"] == "assistant"]
    if not earlier_turns:
        return encode_prompts(tokenizer, [prompt], "chat")["input_ids"][0], answer_ids, []
    if not tokenizer.is_fast:
        raise UsageError(f"conversations of several assistant turns need a fast tokenizer (character offsets); "
                         f"{type(tokenizer).__name__} is not one")
    encoded = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    spans = []
    for turn in earlier_turns:
        before = chat_prompt(tokenizer, messages[:turn])
        text = chat_answer(tokenizer, messages[: turn + 1], before)
        start, end = len(before), len(before) + len(text)
        if prompt[start:end] != text:
            raise UsageError("--prompt_template chat: the tokenizer's chat template renders an earlier assistant "
                             "turn differently once later turns follow, so its tokens cannot be labelled; train "
                             "on conversations cut after each assistant turn instead")
        inside = [index for index, (first, last) in enumerate(encoded["offset_mapping"])
                  if start <= first and last <= end and last > first]
        spans.append([inside[0], inside[-1] + 1])
    return encoded["input_ids"], answer_ids, spans


def fit_conversation(tokenizer, messages: list[dict[str, str]], model_max_length: int):
    """conversation_tokens of the longest run of whole turns, from the first, that ends with an assistant turn
    and fits in `model_max_length`, and how many assistant turns were left out; if not even the first exchange
    fits, that exchange (cut to length later, as an Alpaca record)."""
    ends = [turn for turn, message in enumerate(messages) if message["role"] == "assistant"]
    for left_out, end in enumerate(reversed(ends)):
        prompt_ids, answer_ids, spans = conversation_tokens(tokenizer, messages[: end + 1])
        if len(prompt_ids) + len(answer_ids) <= model_max_length or end == ends[0]:
            return prompt_ids, answer_ids, spans, left_out


def encode_prompts(tokenizer, prompts: list[str], prompt_template: str, return_tensors: str | None = None):
    """Rendered prompts tokenized (the tokenizer's encoding), the same in training and at generation. A chat
    template writes the special tokens it wants (BOS) itself, as transformers' apply_chat_template assumes."""
    return tokenizer(prompts, add_special_tokens=prompt_template == "alpaca", return_tensors=return_tensors)


def _read_local_records(path: str, flag: str) -> list[dict]:
    try:
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read {flag} {path!r}: {error}") from None
    if path.endswith(".jsonl"):
        records = []
        for number, line in enumerate(text.splitlines(), start=1):
            try:
                if line.strip():
                    records.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise UsageError(f"line {number} of {flag} {path!r} is not valid JSON ({error}); "
                                 "JSONL needs one JSON record per line") from None
        return records
    try:
        records = json.loads(text)
    except json.JSONDecodeError as error:
        raise UsageError(
            f"{flag} {path!r} is not valid JSON ({error}); fix the file or convert it to JSON/JSONL"
        ) from None
    if not isinstance(records, list):
        raise UsageError(f"{flag} {path!r} must hold a JSON list of records (or be JSONL, one record per line)")
    return records


def check_conversations(records: list[dict], source: str, last_role: str = "assistant") -> None:
    """Every record a list of messages with string `role` and `content`, the last from `last_role` (the
    assistant's to train on, the user's to answer)."""
    for index, record in enumerate(records):
        messages = record.get(CONVERSATION_FIELD) if isinstance(record, dict) else None
        where = f"record {index} of {source}"
        if not isinstance(messages, list) or not messages:
            raise UsageError(f"{where} has no non-empty {CONVERSATION_FIELD!r} list, which every record of a file "
                             "of conversations needs (conversations and Alpaca records do not mix)")
        for message in messages:
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise UsageError(f"{where}: every message needs a string 'role' and 'content', got {message!r:.80}")
        if messages[-1]["role"] != last_role:
            raise UsageError(f"{where} ends with a {messages[-1]['role']!r} message; it should end with the "
                             f"{last_role}'s turn")


def check_records(records: list[dict], source: str) -> None:
    """Every record needs string `instruction` and `output`; `input` is optional. Or, if the first record has
    `messages`, every record is a conversation (check_conversations)."""
    if records and isinstance(records[0], dict) and CONVERSATION_FIELD in records[0]:
        return check_conversations(records, source)
    for index, record in enumerate(records):
        wrong_type = [key for key in ("instruction", "input", "output") if isinstance(record, dict)
                      and record.get(key) is not None and not isinstance(record[key], str)]
        if wrong_type:
            key = wrong_type[0]
            raise UsageError(f"record {index} of {source} has {key!r}, but as a {type(record[key]).__name__}, not a "
                             f"string; map a string field to {key!r} with --field_map, or convert the records")
        ok = isinstance(record, dict) and all(
            isinstance(record.get(key), str) for key in ("instruction", "output")
        ) and isinstance(record.get("input", ""), (str, type(None)))
        if not ok:
            fields = f" (it has {', '.join(map(repr, record))})" if isinstance(record, dict) else ""
            raise UsageError(
                f"record {index} of {source} lacks a string 'instruction' or 'output'{fields}; every record needs "
                "both ('input' is optional); for other field names pass e.g. --field_map "
                "question=instruction,answer=output"
            )
    if not records:
        raise UsageError(f"{source} holds no records; pass an Alpaca file with at least one example")


def load_records(data_path: str, flag: str = "--data_path", field_map: dict[str, str] | None = None):
    """Alpaca records or conversations from a local .json/.jsonl file or an HF hub dataset, as a
    `datasets.Dataset`. `field_map` renames fields first (--field_map)."""
    field_map = field_map or {}
    if os.path.isfile(data_path):
        records = [{field_map.get(key, key): value for key, value in record.items()} if isinstance(record, dict)
                   else record for record in _read_local_records(data_path, flag)]
        check_records(records, f"{flag} {data_path!r}")
        if records and CONVERSATION_FIELD in records[0]:
            # role and content only: the messages' other keys (names, tool calls) vary from record to record
            return datasets.Dataset.from_dict({CONVERSATION_FIELD: [
                [{"role": m["role"], "content": m["content"]} for m in r[CONVERSATION_FIELD]] for r in records]})
        dataset = datasets.Dataset.from_dict({
            "instruction": [r["instruction"] for r in records],
            "input": [r.get("input") or "" for r in records],
            "output": [r["output"] for r in records],
        })
    else:
        dataset = datasets.load_dataset(data_path, split="train")
        dataset = dataset.rename_columns({k: v for k, v in field_map.items() if k in dataset.column_names})
        if "input" not in dataset.column_names and CONVERSATION_FIELD not in dataset.column_names:
            dataset = dataset.add_column("input", [""] * len(dataset))
        check_records(dataset.select(range(min(len(dataset), 1000))).to_list(), f"{flag} {data_path!r}")
    return dataset


def load_splits(data_path: str, eval_data_path: str | None = None, eval_split_ratio: float | None = None,
                max_n_train_example: int | None = None, seed: int = 42, field_map: dict[str, str] | None = None):
    """(training records, evaluation records or None). A held-out split is taken first, so
    --max_n_train_example never takes evaluation examples; both selections are seeded."""
    records = load_records(data_path, field_map=field_map)
    eval_records = None
    if eval_split_ratio is not None:
        try:
            split = records.train_test_split(test_size=eval_split_ratio, seed=seed)
        except ValueError:  # a split left empty
            raise UsageError(f"--eval_split_ratio {eval_split_ratio} of {len(records)} examples leaves one side "
                             "empty; change the ratio or pass --eval_data_path") from None
        records, eval_records = split["train"], split["test"]
    elif eval_data_path:
        eval_records = load_records(eval_data_path, "--eval_data_path", field_map)
    if max_n_train_example is not None and max_n_train_example < len(records):
        records = records.shuffle(seed=seed).select(range(max_n_train_example))
    return records, eval_records


def tokenize(dataset, tokenizer, model_max_length: int, prompt_template: str = "alpaca"):
    """Adds `input_ids` (prompt + answer + eos, truncated), `prompt_length` and `length`; drops examples left
    without any answer token. Prompt and answer are tokenized separately, so the prompt tokens are
    exactly those the model sees at generation time.

    With a chat template every record is a conversation (an Alpaca record one of two turns: record_conversation),
    tokenized by conversation_tokens, and `label_spans` marks its earlier assistant turns; a conversation longer
    than `model_max_length` loses whole turns from its end first (fit_conversation)."""
    if CONVERSATION_FIELD in dataset.column_names and prompt_template != "chat":
        raise UsageError("conversation records ('messages') are rendered by the model's chat template: add "
                         "--prompt_template chat")

    def tokenize_batch(batch: dict[str, list]) -> dict[str, list]:
        if prompt_template == "alpaca":
            records = list(zip(batch["instruction"], batch["input"], batch["output"]))
            prompt_ids = encode_prompts(tokenizer, [format_prompt(i, x) for i, x, _ in records], "alpaca")["input_ids"]
            answer_ids = [ids + [tokenizer.eos_token_id]
                          for ids in tokenizer([o for _, _, o in records], add_special_tokens=False)["input_ids"]]
            columns = {}
        else:
            conversations = batch.get(CONVERSATION_FIELD) or [
                record_conversation(*record) for record in zip(batch["instruction"], batch["input"], batch["output"])]
            prompt_ids, answer_ids, spans, left_out = zip(*[fit_conversation(tokenizer, messages, model_max_length)
                                                             for messages in conversations])
            columns = {"label_spans": list(spans), "turns_left_out": list(left_out)}
        input_ids = [(p + a)[:model_max_length] for p, a in zip(prompt_ids, answer_ids)]
        return {"input_ids": input_ids, "prompt_length": [len(p) for p in prompt_ids],
                "length": [len(ids) for ids in input_ids], **columns}

    tokenized = dataset.map(
        tokenize_batch, batched=True, batch_size=1000, remove_columns=dataset.column_names,
        desc="Tokenizing", load_from_cache_file=True,
    )
    if "turns_left_out" in tokenized.column_names:
        left_out = np.array(tokenized["turns_left_out"])
        if left_out.any():
            print(f"Cut {np.count_nonzero(left_out)} conversation(s) after an earlier assistant turn to fit "
                  f"--model_max_length {model_max_length}: {left_out.sum()} assistant turn(s) left out.")
        tokenized = tokenized.remove_columns("turns_left_out")
    keep = np.flatnonzero(np.array(tokenized["length"]) > np.array(tokenized["prompt_length"]))
    if len(keep) == 0:
        raise UsageError(
            f"every example's prompt fills --model_max_length {model_max_length}, no output token is left; "
            "raise --model_max_length"
        )
    if len(keep) < len(tokenized):
        print(f"Dropped {len(tokenized) - len(keep)} example(s) whose prompt alone reaches --model_max_length.")
        tokenized = tokenized.select(keep)
    return tokenized


def _dataset_fingerprint(records, tokenizer, model_max_length: int, prompt_template: str) -> str:
    """Everything the tokenized dataset depends on: the records (datasets' own fingerprint, a hash of
    the content and of the seeded selections and splits made of it), the tokenizer's full
    serialization, the templates (Alpaca's or the tokenizer's chat template), the code that builds
    prompts and labels (edit it in a copy and the cache is not reused) and the truncation length."""
    digest = hashlib.sha256(records._fingerprint.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update((backend.to_str() if backend is not None else repr(tokenizer.get_vocab())).encode())
    code = [inspect.getsource(function)
            for function in (format_prompt, user_turn, record_conversation, chat_prompt, chat_answer, encode_prompts,
                             conversation_tokens, fit_conversation, tokenize)]
    digest.update(json.dumps([*code, PROMPT_WITH_INPUT, PROMPT_NO_INPUT, tokenizer.eos_token_id, model_max_length,
                              type(tokenizer).__name__, prompt_template,
                              tokenizer.chat_template if prompt_template == "chat" else None]).encode())
    return digest.hexdigest()[:24]


def prepare_dataset(records, tokenizer, model_max_length: int, cache_dir: str | None = None,
                    prompt_template: str = "alpaca"):
    """Records -> tokenized dataset, cached on disk so that later runs (and the other ranks of this run)
    load it in a second instead of tokenizing again. The cache is checked against its manifest when read, and
    tokenized again if it is damaged."""
    def build(directory: Path) -> None:
        tokenize(records, tokenizer, model_max_length, prompt_template).save_to_disk(str(directory))

    fingerprint = _dataset_fingerprint(records, tokenizer, model_max_length, prompt_template)
    path = cached_directory(cache_root(cache_dir) / "tokenized" / fingerprint, build, "the tokenized data")
    return datasets.load_from_disk(str(path))


def records_fingerprint(records) -> str:
    """SHA-256 of the training records as trained on, in order: their instruction, input and output (or
    messages) after --field_map, --max_n_train_example and the held-out split. Their content, not their file's
    path or date."""
    digest = hashlib.sha256()
    fields = [field for field in RECORD_FIELDS if field in records.column_names]
    for batch in records.select_columns(fields).iter(batch_size=1000):
        digest.update(json.dumps([batch[field] for field in fields]).encode())
    return digest.hexdigest()


def prompt_windows(prompt_length: int, first_n: int, last_n: int) -> tuple[list[int], list[int]]:
    """Positions of the first-n and last-n windows of a prompt; `l1` is the last prompt token.

    A prompt shorter than first_n + last_n shrinks both windows so they never overlap (an overlap
    would apply two interventions of the same layer to one token): the first window gets at most
    half the prompt, the last window the rest. A window left short is padded later by the collator
    with a position that cannot affect the loss.
    """
    n_first = min(first_n, prompt_length // 2 if last_n else prompt_length)
    n_last = min(last_n, prompt_length - n_first)
    return list(range(n_first)), list(range(prompt_length - n_last, prompt_length))


def num_interventions(num_layers: int, position: tuple[int, int], share_weights: bool) -> int:
    """pyreft's layout: with f+l and no weight sharing the layer list is doubled."""
    first_n, last_n = position
    return num_layers * (2 if first_n and last_n and not share_weights else 1)


def intervention_locations(
    prompt_lengths: list[int], position: tuple[int, int], share_weights: bool, num_layers: int,
    pad_position: int | None, offsets: list[int] | None = None,
) -> list[list[list[int]]]:
    """[intervention][example][position] for pyvene's `unit_locations`.

    Interventions 0..L-1 take the first-window positions and L..2L-1 the last-window ones (pyreft's
    semantics), or each takes both windows when they share weights or there is one window. Windows
    shortened by a short prompt are padded with `pad_position`, which must be a position whose
    representation never reaches the loss (the batch's last column, see `Collator`); with one
    example and `pad_position=None` they stay short. `offsets`: where each example starts in its row (a
    pack's examples share one row), added to its positions but not to `pad_position`.
    """
    first_n, last_n = position
    firsts, lasts = [], []
    for length, offset in zip(prompt_lengths, offsets or [0] * len(prompt_lengths)):
        first, last = ([offset + p for p in window] for window in prompt_windows(length, first_n, last_n))
        if pad_position is not None:
            first += [pad_position] * (first_n - len(first))
            last += [pad_position] * (last_n - len(last))
        firsts.append(first)
        lasts.append(last)
    if first_n and last_n and not share_weights:
        return [firsts] * num_layers + [lasts] * num_layers
    both = [first + last for first, last in zip(firsts, lasts)]
    return [both] * num_layers


# What a pack (Collator.pack) gives the model besides its tokens: position_ids, and the examples' boundaries in
# the form transformers' flash attention takes them (FlashAttentionKwargs); other attention implementations
# ignore the boundaries and find the examples from position_ids.
PACK_KEYS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


@dataclass
class Collator:
    """Right-pads a micro-batch and builds labels (prompt and padding masked) and intervention locations.

    With `pad_to_multiple_of` N the padded length is rounded up to a multiple of N: a run then sees at most
    model_max_length / N distinct shapes, so shape-keyed caches (cuDNN attention plans, allocator blocks)
    are built once per length instead of once per step. Padding never reaches the loss (see `summed_token_loss`).
    """

    pad_token_id: int
    position: tuple[int, int]
    share_weights: bool
    num_layers: int
    pad_to_multiple_of: int = 1

    def example_labels(self, example: dict[str, Any], ids):
        """The tokens the loss is on: every token after the prompt (the answer and eos), and in a conversation
        its earlier assistant turns (`label_spans`). The loss's kept logits and the step's label count are derived
        from these, so this is the one place to change them."""
        labels = ids.clone()
        labels[: example["prompt_length"]] = IGNORE_INDEX
        for start, end in example.get("label_spans") or ():
            labels[start:end] = ids[start:end]
        return labels

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        longest = max(len(example["input_ids"]) for example in examples)
        width = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(examples), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(examples), width), dtype=torch.long)
        labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
        for row, example in enumerate(examples):
            ids = torch.tensor(example["input_ids"], dtype=torch.long)
            input_ids[row, : len(ids)] = ids
            attention_mask[row, : len(ids)] = 1
            labels[row, : len(ids)] = self.example_labels(example, ids)
        # Position 0 predicts nothing, so a label there is never counted.
        labels[:, 0] = IGNORE_INDEX
        # Every example has at least one output token after its prompt, so the last column is never a
        # prompt position; its hidden state only feeds its own logits, which predict nothing (causal
        # attention, shifted labels). Intervening there is a no-op: a safe padding position.
        locations = intervention_locations(
            [example["prompt_length"] for example in examples], self.position, self.share_weights,
            self.num_layers, pad_position=width - 1,
        )
        return {"input_ids": input_ids, "attention_mask": attention_mask,
                **self.labels_and_locations(labels, [torch.tensor(window) for window in locations], examples)}

    def pack(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        """The examples end to end in one row, with no padding but up to a multiple of `pad_to_multiple_of` at the
        end (--packing). `position_ids` restart at each example: that is how transformers tells them apart (no
        attention across them: a block-diagonal mask under SDPA and eager, varlen kernels under flash attention,
        which also get the examples' boundaries precomputed here, as transformers' DataCollatorWithFlattening
        gives them). Each example's labels and intervention windows are its own, moved to where it starts; its
        first token is not a label (the token before it is another example's), so the seams predict nothing.
        Every per-token loss and gradient is the padded layout's (tests/test_loss.py)."""
        lengths = [len(example["input_ids"]) for example in examples]
        starts = np.cumsum([0, *lengths[:-1]]).tolist()
        used = sum(lengths)
        width = -(-used // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((1, width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((1, width), IGNORE_INDEX, dtype=torch.long)
        for start, example in zip(starts, examples):
            ids = torch.tensor(example["input_ids"], dtype=torch.long)
            input_ids[0, start : start + len(ids)] = ids
            labels[0, start : start + len(ids)] = self.example_labels(example, ids)
            labels[0, start] = IGNORE_INDEX
        sequence_lengths = lengths + [width - used] * (width > used)  # the padding at the end: a sequence of its own
        position_ids = torch.cat([torch.arange(length) for length in sequence_lengths]).unsqueeze(0)
        boundaries = torch.tensor(np.cumsum([0, *sequence_lengths]), dtype=torch.int32)
        # The last column is the last example's last token (an answer token, never a prompt position) or
        # padding: a safe padding position for the windows, as in __call__. One row holds every example's windows.
        locations = intervention_locations(
            [example["prompt_length"] for example in examples], self.position, self.share_weights,
            self.num_layers, pad_position=width - 1, offsets=starts,
        )
        locations = [torch.tensor([[p for example_window in window for p in example_window]]) for window in locations]
        return {"input_ids": input_ids, "position_ids": position_ids,
                "cu_seq_lens_q": boundaries, "cu_seq_lens_k": boundaries,
                "max_length_q": max(sequence_lengths), "max_length_k": max(sequence_lengths),
                **self.labels_and_locations(labels, locations, examples)}

    def labels_and_locations(self, labels, locations: list, examples: list[dict[str, Any]]) -> dict[str, Any]:
        """What a micro-batch carries besides its tokens: labels, intervention locations and their mask, the loss's
        kept logits and the counts, from `labels` and `locations` (whose padding position is the last column)."""
        width = labels.shape[1]
        labelled_columns = (labels != IGNORE_INDEX).any(dim=0).nonzero()
        first_label = int(labelled_columns[0]) if len(labelled_columns) else width
        # True at the real positions, False at the padding ones (the last column is never a real one): a loss
        # term over the intervened positions sums under this mask, or it also sums over padding, which depends
        # on how the step is cut into micro-batches and ranks.
        intervention_mask = [window != width - 1 for window in locations]
        return {
            "labels": labels,
            # As tensors, built here (in a DataLoader worker) rather than by pyvene from Python lists in
            # every hook of every forward: see `token_losses`.
            "intervention_locations": locations,
            "intervention_mask": intervention_mask,
            # The loss's kept logits (logits_to_keep) and the label count both come from `labels`, whatever marks
            # them: a label can never be counted yet fall outside the logits kept. Counted here, on the
            # host, so that the training step never reads them back from the device.
            "first_label_position": first_label,
            # The logits the loss needs (from the column before the first label, `token_losses`), counted up to
            # a multiple of pad_to_multiple_of as the width is: no more kept-logit shapes than widths.
            "num_kept_logits": min(width, -(-(width - first_label + 1) // self.pad_to_multiple_of)
                                   * self.pad_to_multiple_of),
            "num_label_tokens": int((labels != IGNORE_INDEX).sum()),
            "num_intervened_positions": int(sum(mask.sum() for mask in intervention_mask)),
            "num_tokens": sum(len(example["input_ids"]) for example in examples),
        }


# What the collator counts in each micro-batch, summed over an optimizer step's micro-batches on every rank
# into the step's counts (`step_counts`), which each micro-batch then carries as batch["step_counts"].
STEP_COUNTS = ("num_label_tokens", "num_intervened_positions")


def step_counts(micro_batches: list[dict[str, Any]]) -> list[int]:
    """This process's part of the step's counts, in STEP_COUNTS' order: summed over ranks, the step's."""
    return [sum(batch[key] for batch in micro_batches) for key in STEP_COUNTS]


def give_step_counts(micro_batches: list[dict[str, Any]], counts: list[int]) -> None:
    """Each micro-batch gets the whole step's counts: what a loss term normalizes by to stay exact on N ranks."""
    for batch in micro_batches:
        batch["step_counts"] = dict(zip(STEP_COUNTS, counts))


def packs(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices into `lengths` cut into consecutive runs of at most `max_tokens` tokens each (--packing): each
    run takes the next examples while they fit. No example is longer than `max_tokens` (args.validate)."""
    runs, tokens = [], max_tokens
    for index, length in enumerate(lengths):
        if tokens + length > max_tokens:
            runs.append([])
            tokens = 0
        runs[-1].append(index)
        tokens += length
    return runs


@dataclass
class StepCollator:
    """A DataLoader's collate_fn for `DistributedGlobalBatchSampler`: this rank's share of one global batch (its
    micro-batches, concatenated) -> the list of its collated micro-batches, empty for an empty share.

    Only the last micro-batch of a share can be partial (see `rank_micro_batches`), so cutting the share
    every `per_device_batch_size` examples gives back exactly the rank's micro-batches. With
    `packing_max_tokens` (--packing) the share is cut into `packs` instead, each collated into one row."""

    collate: Collator
    per_device_batch_size: int
    packing_max_tokens: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.packing_max_tokens:
            return [self.collate.pack([examples[index] for index in run])
                    for run in packs([example["length"] for example in examples], self.packing_max_tokens)]
        size = self.per_device_batch_size
        return [self.collate(examples[start : start + size]) for start in range(0, len(examples), size)]


MEGABATCH = 50  # global batches per length-sorted group, as in HF's LengthGroupedSampler


def global_batches(num_examples: int, global_batch_size: int, seed: int, epoch: int,
                   lengths: np.ndarray | None = None, shuffle: bool = True) -> list[list[int]]:
    """The epoch's example order, cut into global batches (one may be partial).

    It depends only on (seed, epoch, the examples' lengths, global batch size): one process and N
    processes with the same global batch walk through exactly the same batches, which is what makes
    them train the same model, and a resumed run finds its place again.

    With `lengths` (--group_by_length), the shuffled order is cut into megabatches of MEGABATCH global
    batches, each sorted by length (longest first) and cut into global batches of similar lengths,
    whose order is then shuffled. A micro-batch is padded to its longest example, so this removes most
    padding. The trade-off: a step's examples are no longer a uniform sample of lengths, so the loss
    varies more from step to step (long and short answers have different per-token losses).
    Without `shuffle`, the dataset's order (and, with `lengths`, the megabatches' order).
    """
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(num_examples) if shuffle else np.arange(num_examples)
    if lengths is None:
        return [order[i : i + global_batch_size].tolist() for i in range(0, num_examples, global_batch_size)]
    span = global_batch_size * MEGABATCH
    batches = []
    for start in range(0, num_examples, span):
        megabatch = order[start : start + span]
        megabatch = megabatch[np.argsort(-lengths[megabatch], kind="stable")]
        batches += [megabatch[i : i + global_batch_size].tolist() for i in range(0, len(megabatch), global_batch_size)]
    return [batches[i] for i in rng.permutation(len(batches))] if shuffle else batches


class DistributedGlobalBatchSampler(Sampler[list[int]]):
    """The global batch plan as a DataLoader `batch_sampler`, with DistributedSampler's interface
    (num_replicas, rank, shuffle, seed, set_epoch) and a resume position (`set_start`).

    Each item is this rank's share of one global batch, i.e. of one optimizer step: its micro-batches of
    `rank_micro_batches`, concatenated (`StepCollator` cuts them again); an empty share is an empty list,
    so every rank yields one item per step. The plan is `global_batches`: the same for any number of
    replicas with the same global batch (per_device x num_replicas x accumulation).
    """

    def __init__(self, num_examples: int, per_device_batch_size: int, accumulation_steps: int = 1,
                 num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0,
                 lengths: np.ndarray | None = None, packing: tuple[np.ndarray, int] | None = None) -> None:
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        self.num_examples, self.per_device_batch_size = num_examples, per_device_batch_size
        self.accumulation_steps, self.num_replicas, self.rank = accumulation_steps, num_replicas, rank
        self.shuffle, self.seed, self.lengths = shuffle, seed, lengths
        self.packing = packing  # (every example's length, --packing_max_tokens), as StepCollator packs
        self.global_batch_size = per_device_batch_size * num_replicas * accumulation_steps
        self.start = 0
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """A new order for each epoch, as with DistributedSampler; call it before each epoch's iteration."""
        self.epoch = epoch
        self.global_batches = global_batches(self.num_examples, self.global_batch_size, self.seed, epoch,
                                             self.lengths, self.shuffle)

    def set_start(self, batch_index: int) -> None:
        """Iterate from this global batch of the epoch on: where a resumed run goes on."""
        self.start = batch_index

    def __len__(self) -> int:
        """Items (optimizer steps) left in this epoch from the start position."""
        return max(0, len(self.global_batches) - self.start)

    def __iter__(self):
        for global_batch in self.global_batches[self.start :]:
            yield self.share(global_batch, self.rank)

    def share(self, global_batch: list[int], rank: int) -> list[int]:
        """`rank`'s micro-batches of a global batch, concatenated."""
        micro_batches = rank_micro_batches(global_batch, rank, self.num_replicas, self.per_device_batch_size,
                                           self.accumulation_steps)
        return [index for micro_batch in micro_batches for index in micro_batch]

    def micro_steps(self, batch_index: int) -> int:
        """The forwards every rank runs in this global batch of the epoch: the accumulation steps, or with packing
        the most packs a rank's share makes (a rank with fewer makes up the rest with placeholders where the
        strategy's collectives need them). Every rank finds the same, with no communication."""
        if self.packing is None:
            return self.accumulation_steps
        lengths, max_tokens = self.packing
        return max(len(packs(lengths[self.share(self.global_batches[batch_index], rank)].tolist(), max_tokens))
                   for rank in range(self.num_replicas))


def rank_micro_batches(
    global_batch: list[int], rank: int, world_size: int, per_device_batch_size: int, accumulation_steps: int
) -> list[list[int]]:
    """This rank's `accumulation_steps` micro-batches of a global batch.

    The global batch is cut into consecutive chunks of `per_device_batch_size`; chunk k goes to
    micro-step k // world_size of rank k % world_size. In a partial global batch some
    micro-batches are empty: the rank still takes part in the step with a zero contribution.
    """
    chunks = [
        global_batch[start : start + per_device_batch_size]
        for start in range(0, len(global_batch), per_device_batch_size)
    ]
    chunks += [[]] * (world_size * accumulation_steps - len(chunks))
    return chunks[rank::world_size]


def eval_batches(lengths: np.ndarray, batch_size: int) -> list[list[int]]:
    """The evaluation set sorted by length (least padding) and cut into batches. The eval loss is a sum over
    tokens, so it does not depend on how the batches are spread over ranks."""
    order = np.argsort(-lengths, kind="stable")
    return [order[i : i + batch_size].tolist() for i in range(0, len(order), batch_size)]


def steps_per_epoch(num_examples: int, global_batch_size: int) -> int:
    return math.ceil(num_examples / global_batch_size)


def loader_workers(num_workers: int) -> dict[str, Any]:
    """A training DataLoader's settings for its `num_workers` workers (--dataloader_num_workers), which collate
    the steps ahead of the training loop."""
    return dict(num_workers=num_workers,
                # Workers end with each epoch's iterator. A persistent iterator lives as long as the DataLoader;
                # left to the garbage collector (a reference cycle), it finds its workers' queues already closed,
                # and the workers, which ignore SIGTERM, then hang the process at exit.
                persistent_workers=False, worker_init_fn=dataloader_worker_init,
                # Each epoch's iterator draws a seed for its workers: from this generator, not from the global
                # RNG, whose stream (dropout) a resumed run must continue exactly.
                generator=torch.Generator())


def dataloader_worker_init(worker_id: int) -> None:
    """DataLoader workers ignore SIGTERM and SIGINT. A cluster or a terminal signals every process of the
    job, workers included; a worker dying of it would fail the step that waits for its batch before
    the main process, which handles the signal (checkpoint.StopSignal), could checkpoint. The main
    process ends its workers itself, and a worker whose parent is gone exits on its own."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
