"""The training data: Alpaca records or conversations (read by `datasets`' loaders from any container, checked,
split), their prompts, and their tokenization, cached on disk."""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib
import inspect
import json
import sys
import sysconfig
from pathlib import Path

import datasets
import numpy as np

from alpaca.constants import (
    ALPACA_FIELDS,
    CONVERSATION_FIELD,
    RECORD_FIELDS,
    RECORD_FORMATS,
    SHAREGPT_FIELD,
    SHAREGPT_ROLES,
)
from alpaca.data_files import read_dataset
from alpaca.errors import UsageError
from alpaca.launcher_env import spare_cores
from alpaca.manifest import cache_root, cached_directory

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
    """Build the chat message of a record (--prompt_template chat): the instruction, then the input if any."""
    return {"role": "user", "content": f"{instruction}\n\n{input}" if input else instruction}


def record_conversation(instruction: str, input: str | None, output: str | None = None) -> list[dict[str, str]]:
    """Return an Alpaca record as a conversation (--prompt_template chat): its user turn, then the output as the
    assistant's turn (none to generate)."""
    return [user_turn(instruction, input)] + ([{"role": "assistant", "content": output}] if output is not None else [])


def chat_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """Return a conversation up to the assistant's next turn, rendered by the tokenizer's chat template."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def chat_answer(tokenizer, messages: list[dict[str, str]], prompt: str) -> str:
    """Return the last (assistant) turn of `messages` as the chat template renders it after `prompt`, the rendering of
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
    """Render the text before the answer: Alpaca's template, or the tokenizer's chat template up to the assistant turn.
    `instruction` may be a conversation (a list of messages, the last the user's), under the chat template."""
    if prompt_template == "alpaca":
        return format_prompt(instruction, input)
    messages = instruction if isinstance(instruction, list) else record_conversation(instruction, input)
    return chat_prompt(tokenizer, messages)


def conversation_tokens(tokenizer, messages: list[dict[str, str]]) -> tuple[list[int], list[int], list[list[int]]]:
    """Tokenize a conversation that ends with an assistant turn: (prompt ids, answer ids, labelled spans of the prompt).
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
    """Return conversation_tokens of the longest run of whole turns, from the first, that ends with an assistant turn
    and fits in `model_max_length`, and how many assistant turns were left out; if not even the first exchange
    fits, that exchange (cut to length later, as an Alpaca record)."""
    ends = [turn for turn, message in enumerate(messages) if message["role"] == "assistant"]
    for left_out, end in enumerate(reversed(ends)):
        prompt_ids, answer_ids, spans = conversation_tokens(tokenizer, messages[: end + 1])
        if len(prompt_ids) + len(answer_ids) <= model_max_length or end == ends[0]:
            return prompt_ids, answer_ids, spans, left_out


def encode_prompts(tokenizer, prompts: list[str], prompt_template: str, return_tensors: str | None = None):
    """Tokenize rendered prompts (the tokenizer's encoding), the same in training and at generation. A chat
    template writes the special tokens it wants (BOS) itself, as transformers' apply_chat_template assumes."""
    return tokenizer(prompts, add_special_tokens=prompt_template == "alpaca", return_tensors=return_tensors)


def record_format(dataset: datasets.Dataset, data_format: str, source: str) -> tuple[str, str | None]:
    """Find the records' format and the column holding the conversations: Alpaca, OpenAI messages or ShareGPT, told from
    the columns and the first turn's keys (--data_format auto), or as forced."""
    columns = dataset.column_names
    conversations = next((column for column in (CONVERSATION_FIELD, SHAREGPT_FIELD) if column in columns), None)
    if data_format == "auto" and conversations:
        first_turn = next((turns[0] for turns in dataset[conversations][:100] if isinstance(turns, list) and turns),
                          None)
        data_format = "sharegpt" if isinstance(first_turn, dict) and first_turn.get("from") is not None else "messages"
    elif data_format == "auto" and "instruction" in columns:
        data_format = "alpaca"
    if "instruction" in columns if data_format == "alpaca" else data_format != "auto" and conversations:
        return data_format, conversations
    expected = (f"not {RECORD_FORMATS[data_format]} records (--data_format)" if data_format != "auto" else
                f"none of the formats accepted: {', '.join(list(RECORD_FORMATS.values())[:-1])} or "
                f"{list(RECORD_FORMATS.values())[-1]}")
    raise UsageError(f"{source} holds records with fields {', '.join(map(repr, columns))}, {expected}; for other "
                     "field names pass e.g. --field_map question=instruction,answer=output")


def as_message(turn, sharegpt: bool, where: str):
    """Return a turn as an OpenAI message of role and content only (their other keys, names or tool calls, vary from
    record to record); ShareGPT's roles by their OpenAI names. A malformed turn is kept as it is, for
    check_conversations to name."""
    if not isinstance(turn, dict):
        return turn
    if sharegpt and turn.get("from") not in SHAREGPT_ROLES:
        raise UsageError(f"{where}: a ShareGPT turn from {turn.get('from')!r}; the roles accepted are "
                         f"{', '.join(SHAREGPT_ROLES)}")
    message = ({"role": SHAREGPT_ROLES[turn["from"]], "content": turn.get("value")} if sharegpt
               else {"role": turn.get("role"), "content": turn.get("content")})
    return message if all(isinstance(value, str) for value in message.values()) else turn


def canonical_records(dataset: datasets.Dataset, source: str, data_format: str = "auto") -> list[dict]:
    """Return each record as an Alpaca record ('input' "" where missing or null) or a list of OpenAI `messages`
    (ShareGPT turns renamed; a top-level 'system' field, as ShareGPT files have, becomes a first system turn)."""
    record_kind, column = record_format(dataset, data_format, source)
    if record_kind == "alpaca":
        width = len(dataset)
        instructions, inputs, outputs = [dataset[field] if field in dataset.column_names else [None] * width
                                         for field in ALPACA_FIELDS]
        return [{"instruction": instruction, "input": input or "", "output": output}
                for instruction, input, output in zip(instructions, inputs, outputs)]
    systems = dataset["system"] if "system" in dataset.column_names else [None] * len(dataset)
    records = []
    for index, (turns, system) in enumerate(zip(dataset[column], systems)):
        if not isinstance(turns, list):
            records.append({CONVERSATION_FIELD: turns})
            continue
        messages = [as_message(turn, record_kind == "sharegpt", f"record {index} of {source}") for turn in turns]
        if isinstance(system, str) and system and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": system})
        records.append({CONVERSATION_FIELD: messages})
    return records


def read_local_records(path: str, flag: str, data_format: str = "auto") -> list[dict]:
    """Read the records of a file (or any source read_dataset reads, its only split) in canonical_records' form:
    Alpaca records (an 'output' may be missing: None) or conversations, not yet checked, each beside the other
    fields of its record (AlpacaEval's `dataset`, an id)."""
    dataset = read_dataset(path, flag, split=None)
    records = canonical_records(dataset, f"{flag} {path!r}", data_format)
    conversations = bool(records) and CONVERSATION_FIELD in records[0]
    read = (CONVERSATION_FIELD, SHAREGPT_FIELD, "system") if conversations else ALPACA_FIELDS
    others = dataset.remove_columns([column for column in dataset.column_names if column in read])
    return [{**other, **record} for other, record in zip(others, records)] if others.column_names else records


def check_conversation(messages, where: str, last_roles: tuple[str, ...] = ("assistant",)) -> None:
    """Check that `messages` is a list of messages with string `role` and `content`, the last from one of
    `last_roles` (the assistant's to train on, the user's to answer); `where` names the record in its file."""
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where} has no non-empty {CONVERSATION_FIELD!r} list, which every record of a file of "
                         "conversations needs (conversations and Alpaca records do not mix)")
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise UsageError(f"{where}: every message needs a string 'role' and 'content', got {message!r:.80}")
    if messages[-1]["role"] not in last_roles:
        turns = " or the ".join(f"{role}'s" for role in last_roles)
        raise UsageError(f"{where} ends with a {messages[-1]['role']!r} message; it should end with the {turns} "
                         "turn")


def check_conversations(records: list[dict], source: str, last_role: str = "assistant") -> None:
    """Check every record of `source` (check_conversation), each named by its index in the file."""
    for index, record in enumerate(records):
        messages = record.get(CONVERSATION_FIELD) if isinstance(record, dict) else None
        check_conversation(messages, f"record {index} of {source}", (last_role,))


def check_records(records: list[dict], source: str) -> None:
    """Check that there is at least one record. Alpaca records (canonical_records) need a string `instruction` and
    `output`; `input` is optional. Conversations are checked by check_conversations."""
    if not records:
        raise UsageError(f"{source} holds no records; pass data with at least one example")
    if CONVERSATION_FIELD in records[0]:
        return check_conversations(records, source)
    for index, record in enumerate(records):
        wrong_type = [key for key in ALPACA_FIELDS if record[key] is not None and not isinstance(record[key], str)]
        if wrong_type:
            key = wrong_type[0]
            raise UsageError(f"record {index} of {source} has {key!r}, but as a {type(record[key]).__name__}, not a "
                             f"string; map a string field to {key!r} with --field_map, or convert the records")
        if record["instruction"] is None or record["output"] is None:
            fields = [key for key, value in record.items() if value]
            raise UsageError(
                f"record {index} of {source} lacks a string 'instruction' or 'output' (it has "
                f"{', '.join(map(repr, fields)) or 'neither'}); every record needs both ('input' is optional); for "
                "other field names pass e.g. --field_map question=instruction,answer=output"
            )


def renamed_fields(dataset: datasets.Dataset, field_map: dict[str, str], source: str) -> datasets.Dataset:
    """Rename the records' fields as --field_map says. Two fields that would get one name (question=instruction
    where the records hold 'instruction' too) are refused: which of them to train on is the user's choice."""
    renames = {field: target for field, target in field_map.items() if field in dataset.column_names}
    for target in dict.fromkeys(renames.values()):
        fields = [column for column in dataset.column_names if renames.get(column, column) == target]
        if len(fields) > 1:
            mapped = ",".join(f"{field}={target}" for field in fields if field in renames)
            raise UsageError(f"--field_map {mapped}: the records of {source} hold {' and '.join(map(repr, fields))}, "
                             f"{len(fields)} fields that would be {target!r}; keep one (drop a mapping from "
                             "--field_map, or a field from the records)")
    return dataset.rename_columns(renames)


def load_records(data_path: str, flag: str = "--data_path", field_map: dict[str, str] | None = None,
                 split: str | None = "train", config: str | None = None, data_format: str = "auto",
                 split_flag: str = "--data_split"):
    """Load Alpaca records or conversations, from any source read_dataset reads, checked, as an in-memory
    `datasets.Dataset` of the canonical columns (instruction, input, output; or messages): the same records
    give the same Dataset whatever their container. `field_map` renames top-level fields first (--field_map)."""
    source = f"{flag} {data_path!r}"
    dataset = renamed_fields(read_dataset(data_path, flag, split, config, split_flag), field_map or {}, source)
    records = canonical_records(dataset, source, data_format)
    check_records(records, source)
    if CONVERSATION_FIELD in records[0]:
        return datasets.Dataset.from_dict({CONVERSATION_FIELD: [record[CONVERSATION_FIELD] for record in records]})
    return datasets.Dataset.from_dict({field: [record[field] for record in records] for field in ALPACA_FIELDS})


def load_training_splits(args: argparse.Namespace):
    """Load the training and evaluation records the flags name (load_splits)."""
    return load_splits(args.data_path, args.eval_data_path, args.eval_split_ratio, args.max_n_train_example,
                       args.seed, args.field_map, args.data_split, args.data_config, args.data_format,
                       args.eval_data_split)


def tokenize_splits(splits, tokenizer, args: argparse.Namespace) -> list:
    """Tokenize each of `splits` (records, or None) as the flags say (prepare_dataset); None stays None."""
    return [None if records is None
            else prepare_dataset(records, tokenizer, args.model_max_length, args.cache_dir, args.prompt_template,
                                 tokenizing_processes(args.preprocessing_num_workers, len(records)))
            for records in splits]


RECORDS_PER_PROCESS = 10_000  # fewer records a process: starting it costs about what it saves


def tokenizing_processes(requested: int | None, records: int) -> int:
    """Return how many processes tokenize `records` records: --preprocessing_num_workers, or by default the cores this
    process can spare (alpaca.launcher_env.spare_cores), one a RECORDS_PER_PROCESS records at most; one where it can
    spare 2 or fewer, whose batches the fast tokenizer's own threads already spread over them (2 processes
    tokenized Alpaca records 0.7x as fast on 2 cores: benchmarks/RESULTS.md)."""
    spare = spare_cores()
    return requested or (1 if spare <= 2 else max(1, min(spare, records // RECORDS_PER_PROCESS)))


def load_splits(data_path: str, eval_data_path: str | None = None, eval_split_ratio: float | None = None,
                max_n_train_example: int | None = None, seed: int = 42, field_map: dict[str, str] | None = None,
                split: str = "train", config: str | None = None, data_format: str = "auto",
                eval_split: str | None = None):
    """Load the training records and the evaluation records (or None). A held-out split is taken first, so
    --max_n_train_example never takes evaluation examples; both selections are seeded."""
    records = load_records(data_path, field_map=field_map, split=split, config=config, data_format=data_format)
    eval_records = None
    if eval_split_ratio is not None:
        try:
            split = records.train_test_split(test_size=eval_split_ratio, seed=seed)
        except ValueError:  # a split left empty
            raise UsageError(f"--eval_split_ratio {eval_split_ratio} of {len(records)} examples leaves one side "
                             "empty; change the ratio or pass --eval_data_path") from None
        records, eval_records = split["train"], split["test"]
    elif eval_data_path:
        eval_records = load_records(eval_data_path, "--eval_data_path", field_map, eval_split, config, data_format,
                                    "--eval_data_split")
    if max_n_train_example is not None and max_n_train_example < len(records):
        records = records.shuffle(seed=seed).select(range(max_n_train_example))
    return records, eval_records


def tokenize(dataset, tokenizer, model_max_length: int, prompt_template: str = "alpaca", num_proc: int = 1):
    """Add `input_ids` (prompt + answer + eos, truncated), `prompt_length` and `length`; drop examples left
    without any answer token. Prompt and answer are tokenized separately, so the prompt tokens are
    exactly those the model sees at generation time.

    With a chat template every record is a conversation (an Alpaca record one of two turns: record_conversation),
    tokenized by conversation_tokens, and `label_spans` marks its earlier assistant turns; a conversation longer
    than `model_max_length` loses whole turns from its end first (fit_conversation). `num_proc` processes tokenize
    a contiguous share each (datasets' map), the same tokens in the same order as one."""
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
        desc="Tokenizing", load_from_cache_file=True, num_proc=num_proc if num_proc > 1 else None,
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


def tokenization_source() -> str:
    """Return the source of this module and of every module it imports or takes a name from that is not installed (in
    the standard library or site-packages): all the code that builds prompts and labels, a helper module a copy
    adds included."""
    installed = tuple({str(Path(path).resolve()) for name, path in sysconfig.get_paths().items()
                       if name in ("stdlib", "platstdlib", "purelib", "platlib")})
    this = sys.modules[__name__]
    tree = ast.parse(inspect.getsource(this))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level == 0}
    imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    modules = {this, *map(importlib.import_module, imported), *map(inspect.getmodule, globals().values())}
    ours = [module for module in modules if getattr(module, "__file__", None)
            and not str(Path(module.__file__).resolve()).startswith(installed)]
    return "".join(inspect.getsource(module) for module in sorted(ours, key=lambda module: module.__name__))


def _dataset_fingerprint(records, tokenizer, model_max_length: int, prompt_template: str) -> str:
    """Hash everything the tokenized dataset depends on: the records (records_fingerprint, their content as trained
    on, whatever their container), the tokenizer's full serialization, the templates (Alpaca's or the tokenizer's
    chat template), the code that builds prompts and labels (tokenization_source: edit it in a copy and the cache
    is not reused) and the truncation length."""
    digest = hashlib.sha256(records_fingerprint(records).encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    digest.update((backend.to_str() if backend is not None else repr(tokenizer.get_vocab())).encode())
    digest.update(json.dumps([tokenization_source(), tokenizer.eos_token_id, model_max_length,
                              type(tokenizer).__name__, prompt_template,
                              tokenizer.chat_template if prompt_template == "chat" else None]).encode())
    return digest.hexdigest()[:24]


def prepare_dataset(records, tokenizer, model_max_length: int, cache_dir: str | None = None,
                    prompt_template: str = "alpaca", num_proc: int = 1):
    """Turn records into a tokenized dataset (in `num_proc` processes), cached on disk so that later runs (and the
    other ranks of this run) load it in a second instead of tokenizing again; the key does not depend on
    `num_proc`, which changes no token. The cache is checked against its manifest when read, and tokenized again if
    it is damaged."""
    def build(directory: Path) -> None:
        tokenize(records, tokenizer, model_max_length, prompt_template, num_proc).save_to_disk(str(directory))

    fingerprint = _dataset_fingerprint(records, tokenizer, model_max_length, prompt_template)
    path = cached_directory(cache_root(cache_dir) / "tokenized" / fingerprint, build, "the tokenized data")
    return datasets.load_from_disk(str(path))


def records_fingerprint(records) -> str:
    """Return the SHA-256 of the training records as trained on, in order: their instruction, input and output (or
    messages) after --field_map, --max_n_train_example and the held-out split. Their content, not their file's
    path or date."""
    digest = hashlib.sha256()
    fields = [field for field in RECORD_FIELDS if field in records.column_names]
    for batch in records.select_columns(fields).iter(batch_size=1000):
        digest.update(json.dumps([batch[field] for field in fields]).encode())
    return digest.hexdigest()
