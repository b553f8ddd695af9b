"""Every container and record format --data_path takes, read by `datasets`' own loaders: the same records give
the same records, fingerprint and run whatever their container; ShareGPT and OpenAI messages are the same
conversations; what real files hold (nulls, CSV's text, a 'system' field) is read as meant. And the tokenized
cache's key covers the code that builds prompts and labels."""

import gzip
import importlib
import json
import runpy
import subprocess
import sys
from pathlib import Path

import datasets
import pandas
import pytest
import torch
from conftest import REPO, intervention_weights, mixed_records, run_in_process, training_flags
from test_conversations import CONVERSATION, write_jsonl

from alpaca.data import load_records, load_splits, records_fingerprint
from alpaca.data_source import data_source
from alpaca.errors import UsageError

SHAREGPT_NAMES = {"system": "system", "user": "human", "assistant": "gpt"}


def as_sharegpt(messages: list[dict]) -> list[dict]:
    return [{"from": SHAREGPT_NAMES[message["role"]], "value": message["content"]} for message in messages]


@pytest.fixture
def offline_hub(monkeypatch):
    """load_dataset(name) reads datasets' cache, as on a machine without network (the tests never reach the hub)."""
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def cached_hub_dataset(name: str, splits: dict[str, list[dict]]) -> str:
    """`name` in datasets' cache as an online `load_dataset(name)` leaves a hub dataset (config/version/hash, an
    arrow file a split), for `load_dataset(name)` offline to read; `name`."""
    from datasets.packaged_modules.json.json import Json

    cache, cached_name = Path(datasets.config.HF_DATASETS_CACHE), name.replace("/", "___")
    staging = cache / "staging" / cached_name
    staging.mkdir(parents=True)
    for split, records in splits.items():
        (staging / f"{split}.json").write_text(json.dumps(records))
    files = datasets.data_files.DataFilesDict.from_patterns({split: [str(staging / f"{split}.json")]
                                                             for split in splits})
    builder = Json(cache_dir=str(staging / "cache"), dataset_name=cached_name, data_files=files)
    builder.download_and_prepare()
    target = cache / cached_name / "default" / "0.0.0" / "0123abcd"
    target.mkdir(parents=True)
    for path in Path(builder.cache_dir).iterdir():
        path.rename(target / path.name.replace(f"{cached_name}-", f"{name.split('/')[-1]}-"))
    return name


def containers(records: list[dict], directory: Path) -> dict[str, str]:
    """The same records in every container --data_path takes, each written as its usual tool writes it."""
    dataset = datasets.Dataset.from_list(records)
    (directory / "records.json").write_text(json.dumps(records))
    (directory / "records.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    (directory / "shards").mkdir()
    half = len(records) // 2
    for shard, part in enumerate((records[:half], records[half:])):  # a glob of shards, as hub datasets are kept
        pandas.DataFrame(part).to_parquet(directory / "shards" / f"train-{shard:05d}.parquet")
    dataset.to_csv(directory / "records.csv", index=False)
    dataset.save_to_disk(directory / "saved")
    datasets.DatasetDict({"train": dataset, "test": dataset.select([0])}).save_to_disk(directory / "saved_dict")
    arrow = next(Path(file["filename"]) for file in datasets.load_from_disk(directory / "saved").cache_files)
    (directory / "records.arrow").write_bytes(arrow.read_bytes())
    paths = {name: str(directory / file) for name, file in {
        "json": "records.json", "jsonl": "records.jsonl", "parquet glob": "shards/*.parquet", "csv": "records.csv",
        "arrow": "records.arrow", "save_to_disk": "saved", "save_to_disk DatasetDict": "saved_dict"}.items()}
    return {**paths, "hub": cached_hub_dataset(f"tests/{directory.name}", {"train": records, "test": records[:1]})}


def quirky_records() -> list[dict]:
    """Alpaca records as real files hold them: 'input' missing (null in a columnar file), empty (None in a
    CSV read naively), text that looks like a number."""
    records = mixed_records()[:6]
    del records[2]["input"]
    records[1]["output"] = "007"
    return records


def test_every_container_gives_the_same_records_fingerprint_and_run(tiny_model, tmp_path, offline_hub):
    """json, jsonl, a glob of parquet shards, csv, arrow, save_to_disk (Dataset and DatasetDict) and a hub
    dataset: the same records, the same content fingerprint (resume binding, tokenized cache), and runs of a
    few steps whose interventions are equal bit for bit."""
    records = quirky_records()
    expected = [{"instruction": r["instruction"], "input": r.get("input", ""), "output": r["output"]} for r in records]
    (tmp_path / "data").mkdir()
    runs = {}
    for name, path in containers(records, tmp_path / "data").items():
        loaded = load_records(path)
        assert loaded.to_list() == expected, name
        assert records_fingerprint(loaded) == records_fingerprint(load_records(str(tmp_path / "data" / "records.json")))
        output_dir = tmp_path / name.replace(" ", "_")
        status, _, stderr = run_in_process("train.py", training_flags(
            tiny_model, path, output_dir, "--max_steps", "2", "--per_device_train_batch_size", "2",
            "--num_sample_answers", "0", "--cache_dir", str(tmp_path / name.replace(" ", "_") / "cache")))
        assert status == 0, f"{name}: {stderr[-2000:]}"
        runs[name] = intervention_weights(output_dir)
    reference = runs.pop("json")
    for name, weights in runs.items():
        assert weights.keys() == reference.keys() and all(torch.equal(weights[k], reference[k]) for k in weights), name


@pytest.mark.fast
def test_csv_files_as_excel_and_pandas_write_them_and_gzipped(tmp_path):
    """Excel's "CSV UTF-8" (a byte-order mark, CRLF lines), pandas' to_csv with its index (an unnamed first column)
    and a .csv.gz: the records they hold, their cells as text, as `datasets` reads them."""
    records = quirky_records()
    expected = [{"instruction": r["instruction"], "input": r.get("input", ""), "output": r["output"]} for r in records]
    frame = pandas.DataFrame(records)
    frame.to_csv(tmp_path / "excel.csv", index=False, encoding="utf-8-sig", lineterminator="\r\n")
    frame.to_csv(tmp_path / "indexed.csv")
    frame.to_csv(tmp_path / "records.csv.gz", index=False)
    assert (tmp_path / "excel.csv").read_bytes().startswith(b"\xef\xbb\xbf")
    assert (tmp_path / "indexed.csv").read_text().startswith(",instruction,")
    for name in ("excel.csv", "indexed.csv", "records.csv.gz"):
        assert load_records(str(tmp_path / name)).to_list() == expected, name


@pytest.mark.fast
def test_a_file_whose_name_holds_glob_characters_is_that_file(tmp_path):
    """--data_path 'data[1].json' names that file, beside a data1.json its pattern matches and alone; a pattern
    that names no file is still a glob."""
    records = mixed_records()[:4]
    (tmp_path / "data[1].json").write_text(json.dumps(records[:2]))
    (tmp_path / "data1.json").write_text(json.dumps(records[2:]))
    literal = str(tmp_path / "data[1].json")
    assert load_records(literal)["instruction"] == [r["instruction"] for r in records[:2]]
    assert load_records(str(tmp_path / "data[0-9].json"))["instruction"] == [r["instruction"] for r in records[2:]]
    (tmp_path / "data1.json").unlink()
    assert data_source("--data_path", literal).files == (literal,)
    assert load_records(literal)["instruction"] == [r["instruction"] for r in records[:2]]


@pytest.mark.fast
def test_a_directory_or_file_whose_name_datasets_would_misread_is_read_as_itself(tmp_path):
    """A directory named with glob characters (raw[1]/, beside a raw1/ its pattern matches) is read with its splits,
    as datasets reads a directory; a file or a directory whose name holds `::` (fsspec's URL chaining) or a colon
    is read as itself."""
    records = mixed_records()[:5]
    for name, part in (("raw[1]", records[:3]), ("raw1", records[3:]), ("v1::raw", records[1:])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.json").write_text(json.dumps(part))
    (tmp_path / "raw[1]" / "test.json").write_text(json.dumps(records[3:]))
    (tmp_path / "data::v1.json").write_text(json.dumps(records[:2]))
    (tmp_path / "data:v2.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records[2:]))
    instructions = [record["instruction"] for record in records]
    assert load_records(str(tmp_path / "raw[1]"))["instruction"] == instructions[:3]
    assert load_records(str(tmp_path / "raw[1]"), split="test")["instruction"] == instructions[3:]
    assert load_records(str(tmp_path / "v1::raw"))["instruction"] == instructions[1:]
    assert load_records(str(tmp_path / "data::v1.json"))["instruction"] == instructions[:2]
    assert load_records(str(tmp_path / "data:v2.jsonl"))["instruction"] == instructions[2:]


@pytest.mark.fast
def test_a_file_of_null_is_one_line_not_a_crash(tmp_path):
    """A .json holding null, a .jsonl of one null line, a gzipped one with a null line further down, an array with
    a null record: pyarrow's JSON reader, which datasets' runs first, crashes the process on such a line (a
    segmentation fault; datasets writes an array's records as lines first); each is one line naming it. In a child
    process, so that a crash cannot take the test session with it."""
    files = {"null.json": b"null", "null.jsonl": b"null\n",
             "later.jsonl.gz": gzip.compress(b'{"instruction": "a", "output": "b"}\n  null \n'),
             "array.json": b'[null, {"instruction": "a", "output": "b"}]'}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    read_each = ("import sys\nfrom alpaca.data import load_records\nfrom alpaca.errors import UsageError\n"
                 "for path in sys.argv[1:]:\n    try:\n        load_records(path)\n"
                 "    except UsageError as error:\n        print(error)\n")
    result = subprocess.run([sys.executable, "-c", read_each, *(str(tmp_path / name) for name in files)], cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        f"--data_path {str(tmp_path / name)!r}: {where} of {tmp_path / name} is null, not a record (a JSON "
        "object); remove it, or write the record there"
        for name, where in zip(files, ("line 1", "line 1", "line 2", "record 0"))]
    # an array as json.dumps(indent=...) writes it, a null alone on a line inside a record: read (datasets hands
    # pyarrow each record on a line of its own)
    (tmp_path / "indented.json").write_text(json.dumps([{"instruction": "a", "output": "b", "tags": {"x": None}}],
                                                       indent=1))
    assert load_records(str(tmp_path / "indented.json"))["instruction"] == ["a"]


@pytest.mark.fast
def test_an_alpaca_eval_file_keeps_each_record_s_dataset(tmp_path):
    """AlpacaEval's own file (instruction, output, generator, dataset; no bare instruction in it) given to
    generate.py --instructions_file, as it is and gzipped: each answer names its record's `dataset`, not the
    file's name."""
    records = [{"instruction": record["instruction"], "output": record["output"], "generator": "text_davinci_003",
                "dataset": dataset} for record, dataset in zip(mixed_records()[:3], ("helpful_base", "oasst", "koala"))]
    (tmp_path / "alpaca_eval.json").write_text(json.dumps(records))
    with gzip.open(tmp_path / "alpaca_eval.jsonl.gz", "wt") as file:
        file.writelines(json.dumps(record) + "\n" for record in records)
    read_instructions = runpy.run_path(str(REPO / "examples" / "generate.py"))["read_instructions"]
    for name in ("alpaca_eval.json", "alpaca_eval.jsonl.gz"):
        items = read_instructions(str(tmp_path / name))
        assert [(item["instruction"], item["dataset"]) for item in items] == [(r["instruction"], r["dataset"])
                                                                              for r in records], name


def test_sharegpt_and_openai_messages_are_the_same_conversations(tmp_path):
    """ShareGPT's human/gpt/system turns (or user/assistant), in JSON or in parquet's nested lists, a top-level
    'system' field as a first system turn: the OpenAI messages they mean; --data_format forces a format, and one
    the records do not have is refused in one line."""
    messages = load_records(write_jsonl(tmp_path / "messages.jsonl", [{"messages": CONVERSATION}] * 2))
    sharegpt = [{"conversations": as_sharegpt(CONVERSATION)},
                {"conversations": as_sharegpt(CONVERSATION[1:]), "system": CONVERSATION[0]["content"]}]
    sharegpt[1]["conversations"][0]["from"] = "user"  # some files keep OpenAI's role names
    pandas.DataFrame(sharegpt).to_parquet(tmp_path / "sharegpt.parquet")
    for path in (write_jsonl(tmp_path / "sharegpt.jsonl", sharegpt), tmp_path / "sharegpt.parquet"):
        records = load_records(str(path))
        assert records.to_list() == messages.to_list() and records_fingerprint(records) == records_fingerprint(messages)
    assert load_records(str(tmp_path / "sharegpt.jsonl"), data_format="sharegpt").to_list() == messages.to_list()
    renamed = write_jsonl(tmp_path / "dialog.jsonl", [{"dialog": as_sharegpt(CONVERSATION)}] * 2)
    assert load_records(str(renamed), field_map={"dialog": "messages"}).to_list() == messages.to_list()
    with pytest.raises(UsageError, match=r"holds records with fields 'conversations', 'system', not Alpaca "
                                         r"\('instruction', 'output', optional 'input'\) records \(--data_format\)"):
        load_records(str(tmp_path / "sharegpt.jsonl"), data_format="alpaca")
    with pytest.raises(UsageError, match=r"fields 'dialog', none of the formats accepted: Alpaca .*, OpenAI "
                                         r"'messages' .* or ShareGPT 'conversations'"):
        load_records(str(renamed))


def test_a_split_of_a_dataset_dict_for_training_and_another_for_evaluation(tmp_path):
    records = mixed_records()[:5]
    splits = {"train": records[:3], "test": records[3:]}
    datasets.DatasetDict({name: datasets.Dataset.from_list(part) for name, part in splits.items()}).save_to_disk(
        tmp_path / "saved")
    train, held_out = load_splits(str(tmp_path / "saved"), str(tmp_path / "saved"), eval_split="test")
    assert train["instruction"] == [r["instruction"] for r in records[:3]]
    assert held_out["instruction"] == [r["instruction"] for r in records[3:]]
    with pytest.raises(UsageError, match="has several splits: its splits are 'train', 'test'; pick one with "
                                         "--eval_data_split"):
        load_splits(str(tmp_path / "saved"), str(tmp_path / "saved"))



@pytest.mark.fast
def test_the_tokenized_cache_key_covers_a_helper_module_a_copy_adds(tokenizer, tiny_data, tmp_path, monkeypatch):
    """A copy of alpaca/data.py whose format_prompt calls a helper of a module of its own: an edit of the helper
    alone changes the key, so a stale tokenization is never read back."""
    package = tmp_path / "recipe"
    package.mkdir()
    (package / "__init__.py").write_text("")
    signature = 'def format_prompt(instruction: str, input: str | None = "") -> str:\n'
    source = (REPO / "alpaca" / "data.py").read_text()
    (package / "data.py").write_text(source.replace(signature, f"{signature}    return wrap(instruction)\n").replace(
        "import datasets\n", "import datasets\nfrom recipe.templates import wrap\n", 1))
    monkeypatch.syspath_prepend(str(tmp_path))

    def key(template: str) -> str:
        (package / "templates.py").write_text(f"def wrap(instruction):\n    return {template!r}.format(instruction)\n")
        for name in ("recipe", "recipe.data", "recipe.templates"):
            sys.modules.pop(name, None)
        importlib.invalidate_caches()
        data = importlib.import_module("recipe.data")
        records = data.load_records(str(tiny_data))
        assert data.format_prompt("Hi") == template.format("Hi")
        return data._dataset_fingerprint(records, tokenizer, 512, "alpaca")

    assert key("Q: {}\nA: ") != key("Question: {}\nAnswer: ")
