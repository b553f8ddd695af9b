"""Shared fixtures: a tiny random Llama with a tiny BPE tokenizer, and small Alpaca files; all built offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SAMPLE_DATA = REPO / "examples" / "data" / "alpaca_sample.json"


def build_tiny_model(directory: Path, pad_token: bool = False, unk_token: bool = True) -> Path:
    """A 4-layer Llama (hidden 64) and a BPE tokenizer trained on the shipped sample data."""
    import torch
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


def write_records(path: Path, count: int) -> Path:
    """The first `count` records of the shipped sample, with and without input (odd counts make
    partial last batches)."""
    records = json.loads(SAMPLE_DATA.read_text())[:count]
    path.write_text(json.dumps(records, ensure_ascii=False))
    return path


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    return write_records(tmp_path_factory.mktemp("data") / "alpaca.json", 21)


def run_script(args: list[str], cwd: Path = REPO, env: dict | None = None, timeout: int = 300,
               launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run one of the project's scripts in a fresh interpreter (as a user would) and capture its output."""
    command = (launcher or [sys.executable]) + args
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **(env or {})}
    for name in ("WANDB_MODE", "WANDB_API_KEY"):  # tests never reach wandb's servers
        full_env.pop(name, None)
    return subprocess.run(command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
