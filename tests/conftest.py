"""Shared fixtures: a tiny random Llama with a tiny BPE tokenizer, and small Alpaca files; all built offline."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alpaca.checkpoint import checkpoints
from alpaca.output import read_metrics

REPO = Path(__file__).resolve().parent.parent
SAMPLE_DATA = REPO / "examples" / "data" / "alpaca_sample.json"


def build_tiny_model(directory: Path, pad_token: bool = False, unk_token: bool = True) -> Path:
    """A 4-layer Llama (hidden 64) and a BPE tokenizer trained on the shipped sample data."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    special = ["<s>", "</s>"] + (["<unk>"] if unk_token else []) + (["<pad>"] if pad_token else [])
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>" if unk_token else None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    records = json.loads(SAMPLE_DATA.read_text())
    texts = [r["instruction"] + " " + r["input"] + " " + r["output"] for r in records]
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>" if unk_token else None,
                                   pad_token="<pad>" if pad_token else None)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         # Large random weights give peaked attention, so interventions on a few prompt
                         # positions move the output loss visibly (at 0.02 everything is near uniform).
                         initializer_range=0.3)
    LlamaForCausalLM(config).save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory



@pytest.fixture(scope="session", autouse=True)
def private_cache(tmp_path_factory):
    """Tokenized datasets (and any converted model) go to a throwaway cache, not the user's."""
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


def write_records(path: Path, count: int, start: int = 0) -> Path:
    """`count` records of the shipped sample from `start` on, with and without input (odd counts make
    partial last batches)."""
    records = json.loads(SAMPLE_DATA.read_text())[start : start + count]
    path.write_text(json.dumps(records, ensure_ascii=False))
    return path


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return write_records(tmp_path_factory.mktemp("data") / "alpaca.json", 21)


@pytest.fixture(scope="session")
def tiny_eval_data(tmp_path_factory) -> Path:
    """5 held-out records: in batches of 2 that is 3 batches, so 2 ranks hold 2 and 1."""
    return write_records(tmp_path_factory.mktemp("data") / "alpaca_eval.json", 5, start=21)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_script(args: list[str], cwd: Path = REPO, env: dict | None = None, timeout: int = 300,
               launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run one of the project's scripts in a fresh interpreter (as a user would) and capture its output."""
    command = (launcher or [sys.executable]) + args
    # On CPU even where a GPU is visible: the tests compare float32 results of 1 and 2 processes (gloo).
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "",
                **(env or {})}
    for name in ("WANDB_MODE", "WANDB_API_KEY"):  # tests never reach wandb's servers
        full_env.pop(name, None)
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)


COMMON = ["--layers", "1;3", "--position", "f2+l2", "--rank", "4", "--learning_rate", "1e-2", "--num_train_epochs",
          "3", "--logging_steps", "1", "--num_sample_answers", "0", "--warmup_steps", "2"]


def torchrun(nproc: int, args: list[str], extra: list[str] | None = None, timeout: int = 300, env: dict | None = None):
    return run_script(["--nproc_per_node", str(nproc), *(extra or []), *args],
                      launcher=[sys.executable, "-m", "torch.distributed.run"], timeout=timeout, env=env)


def intervention_weights(directory) -> dict[str, torch.Tensor]:
    return {f"{path.name}/{name}": tensor for path in sorted(directory.glob("intkey_*.bin"))
            for name, tensor in torch.load(path).items()}


def eval_losses(directory) -> dict[int, float]:
    return {record["step"]: record["eval_loss"] for record in read_metrics(directory) if "eval_loss" in record}


def assert_same_model(actual_dir, expected_dir):
    actual, expected = intervention_weights(actual_dir), intervention_weights(expected_dir)
    assert actual.keys() == expected.keys() and actual
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-4, atol=1e-6, msg=key)
    for key in ("loss", "eval_loss"):
        actual = {r["step"]: r[key] for r in read_metrics(actual_dir) if key in r}
        expected = {r["step"]: r[key] for r in read_metrics(expected_dir) if key in r}
        assert actual == pytest.approx(expected, rel=1e-5), key


# Dropout makes the RNG part of the state: an exact resume must restore it.
FLAGS = ["--layers", "1;3", "--position", "f2+l2", "--rank", "4", "--learning_rate", "1e-2", "--dropout", "0.1",
         "--max_steps", "9", "--logging_steps", "1", "--num_sample_answers", "0", "--save_strategy", "steps",
         "--save_steps", "2", "--per_device_train_batch_size", "2", "--warmup_steps", "2"]
FAULTS = str(REPO / "tests" / "faults.py")


def flags(tiny_model, tiny_data, output_dir, *extra):
    return ["--model_name_or_path", str(tiny_model), "--data_path", str(tiny_data), "--output_dir",
            str(output_dir), *FLAGS, *extra]


@pytest.fixture(scope="session")
def runs(tiny_model, tiny_data, tiny_eval_data, tmp_path_factory):
    """21 examples, global batch 8: the last global batch of each epoch is partial (5 examples), and in it
    rank 1's last micro-batch is empty. Evaluated on 5 held-out examples at steps 4, 8 and 9 (the last)."""
    root = tmp_path_factory.mktemp("runs")
    data = ["--model_name_or_path", str(tiny_model), "--data_path", str(tiny_data), *COMMON,
            "--eval_data_path", str(tiny_eval_data), "--eval_strategy", "steps", "--eval_steps", "4",
            "--per_device_eval_batch_size", "2"]
    single = run_script(["train.py", *data, "--output_dir", str(root / "single"),
                         "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "4"])
    assert single.returncode == 0, single.stderr[-3000:]
    ddp = torchrun(2, ["train_multigpu.py", *data, "--output_dir", str(root / "ddp"),
                       "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"],
                   extra=["--log-dir", str(root / "logs"), "--redirects", "3"])
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    return root, data


@pytest.fixture(scope="session")
def reference(tiny_model, tiny_data, tmp_path_factory):
    """Uninterrupted runs: one process (accumulation 4) and two (accumulation 2); global batch 8."""
    root = tmp_path_factory.mktemp("reference")
    single = run_script(["train.py", *flags(tiny_model, tiny_data, root / "single"),
                         "--gradient_accumulation_steps", "4"])
    assert single.returncode == 0, single.stderr[-3000:]
    ddp = torchrun(2, ["train_multigpu.py", *flags(tiny_model, tiny_data, root / "ddp"),
                       "--gradient_accumulation_steps", "2"])
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    assert [path.name for path in checkpoints(root / "single")] == ["checkpoint-2", "checkpoint-4", "checkpoint-6",
                                                                   "checkpoint-8"]
    without_dropout = run_script(["train.py", *flags(tiny_model, tiny_data, root / "single-no-dropout"),
                                  "--gradient_accumulation_steps", "4", "--dropout", "0"])
    assert without_dropout.returncode == 0, without_dropout.stderr[-3000:]
    return root
