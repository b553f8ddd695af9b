"""Every container and record format --data_path takes, read by `datasets`' own loaders: the same records give
the same records, fingerprint and run whatever their container; ShareGPT and OpenAI messages are the same
conversations; what real files hold (nulls, CSV's text, a 'system' field) is read as meant."""

import json
from pathlib import Path

import datasets
import pandas
import pytest
import torch
from conftest import intervention_weights, mixed_records, run_in_process, training_flags

from alpaca.data import load_records, records_fingerprint

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Name a color."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another one?"},
    {"role": "assistant", "content": "Red, and green."},
]
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
