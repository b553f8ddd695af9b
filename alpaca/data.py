"""The training data: Alpaca records or conversations (read, checked, split), their prompts, and their
tokenization, cached on disk."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from pathlib import Path

import datasets
import numpy as np

from alpaca.constants import CONVERSATION_FIELD, RECORD_FIELDS
from alpaca.errors import UsageError
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


def read_local_records(path: str, flag: str) -> list[dict]:
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
                   else record for record in read_local_records(data_path, flag)]
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
