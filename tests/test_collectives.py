"""The collectives as NCCL takes them, held on CPU processes by a ledger (tests/collective_ledger.py): on every way a
run ends, every rank issues the same collectives in the same order, each tensor on its rank's training device (the
per-step agreement on the CPU, in its own gloo group), and every group waits --ddp_timeout; under DDP (3 processes),
FSDP, ZeRO-2 and ZeRO-3 (2). The divergence exit's ledger: tests/test_divergence.py. On CPU processes every tensor is
on the CPU: the device rule bites under NCCL (benchmarks/gpu_check.sh section 10), and here through the meta
device standing in for a GPU where the device is chosen (the tests at the end)."""

import json

import pytest
import torch
from collective_ledger import SAMPLE_ANSWERS, check, collectives
from conftest import (
    FAULTS,
    LAYERS,
    REPO,
    deepspeed_config_file,
    exit_statuses,
    run_in_process,
    torchrun,
    training_flags,
    write_records,
)

import alpaca.sharding
from alpaca.args import parse_args
from alpaca.generation import sample_answers
from alpaca.model import build_reft_model, load_base_model
from alpaca.output import FINISHED_FILE
from alpaca.sharding import empty_base_model, load_shards
from alpaca.zero import fill_model_sized

# Not torch's default (1800 s): every group must wait this, and no rank wait in one for work of another's.
TIMEOUT_S = 120
# A run with an eval set, checkpoints and sample answers: 4 steps of 4 (16 of the 20 records; 4 held out).
ENDING = ["--max_steps", "4", "--per_device_train_batch_size", "2", "--eval_split_ratio", "0.2",
          "--eval_strategy", "steps", "--eval_steps", "2", "--per_device_eval_batch_size", "2",
          "--save_strategy", "steps", "--save_steps", "2", "--logging_steps", "1", "--num_sample_answers", "2",
          "--max_new_tokens", "4", "--ddp_timeout", str(TIMEOUT_S)]
STRATEGIES = {"ddp": (3, []), "fsdp": (2, ["--fsdp"]), "zero2": (2, ["--deepspeed", 2]),
              "zero3": (2, ["--deepspeed", 3])}
REPLICATED = ("ddp", "zero2")  # the base whole on every rank: rank 0 answers alone


def recorded(nproc: int, args: list, ledger, env: dict | None = None):
    """torchrun `args` through tests/faults.py, its collectives recorded in the directory `ledger`."""
    return torchrun(nproc, [FAULTS, *map(str, args)], env={"LEDGER": str(ledger), **(env or {})})


def after_the_answers_start(records: list[dict]) -> list[dict] | None:
    """The collectives a rank issued once its sample answers started (None: it answered none)."""
    kinds = [record["kind"] for record in records]
    return collectives(records[kinds.index(SAMPLE_ANSWERS):]) if SAMPLE_ANSWERS in kinds else None


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_ending_issues_the_same_collectives_on_every_rank(tiny_model, tmp_path, name):
    """A finished run, the requeue of it, a resume refused, a stop signal and a failed save on rank 0: each ends as
    it should, its ledger in step. The finished run's sample answers come after its output: with a replicated base
    on rank 0 alone, after its last collective (no rank waits for them, however long they take); with a sharded
    one on every rank, in step."""
    nproc, strategy = STRATEGIES[name]
    if strategy[:1] == ["--deepspeed"]:
        strategy = ["--deepspeed", deepspeed_config_file(tmp_path, strategy[1])]
    data = write_records(tmp_path / "data.json", 20)
    run = tmp_path / "run"
    flags = ["train_multigpu.py", *training_flags(tiny_model, data, run, *ENDING, *strategy)]

    finished = recorded(nproc, flags, tmp_path / "finished")
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert "Trained to step 4" in finished.stdout and "REFT MODEL" in finished.stdout
    assert json.loads((run / FINISHED_FILE).read_text())["step"] == 4
    ledger = check(tmp_path / "finished", nproc, TIMEOUT_S)
    assert any(record.get("site", "").endswith(":evaluation_record") for record in ledger[0])  # the eval ran
    answering = [after_the_answers_start(records) for _, records in sorted(ledger.items())]
    if name in REPLICATED:
        assert answering == [[]] + [None] * (nproc - 1), answering
    else:
        assert all(answering) and all(len(calls) == len(answering[0]) for calls in answering), answering

    requeued = recorded(nproc, [*flags, "--resume_from_checkpoint", "auto"], tmp_path / "requeued")
    assert requeued.returncode == 0 and "Nothing to train" in requeued.stdout, requeued.stderr[-3000:]
    check(tmp_path / "requeued", nproc, TIMEOUT_S)

    refused = recorded(nproc, [*flags, "--resume_from_checkpoint", run / "checkpoint-2", "--output_dir",
                               tmp_path / "other", "--rank", "2"], tmp_path / "refused")
    assert refused.returncode != 0 and "--rank" in refused.stderr, refused.stderr[-3000:]
    check(tmp_path / "refused", nproc, TIMEOUT_S)

    stopped = recorded(nproc, [*flags, "--output_dir", tmp_path / "stopped"], tmp_path / "stopped-ledger",
                       {"FAULT": "sigterm", "FAULT_STEP": "3"})
    assert (tmp_path / "stopped" / "checkpoint-2").is_dir(), stopped.stderr[-3000:]
    assert sorted(exit_statuses(stopped.stderr)) == [1] * (nproc - 1) + [128 + 15], stopped.stderr[-3000:]
    check(tmp_path / "stopped-ledger", nproc, TIMEOUT_S)

    unsaved = recorded(nproc, [*flags, "--output_dir", tmp_path / "unsaved", "--save_strategy", "no"],
                       tmp_path / "unsaved-ledger", {"FAULT": "write", "FAULT_STEP": "5"})
    assert exit_statuses(unsaved.stderr) == [1] * nproc, unsaved.stderr[-3000:]
    assert "No space left on device" in unsaved.stderr
    check(tmp_path / "unsaved-ledger", nproc, TIMEOUT_S)


# -- what only NCCL refuses, where it shows on CPU -----------------------------------------------------------------
def test_sample_answers_are_built_on_the_training_device(tiny_model, monkeypatch):
    """Under --fsdp offload the base's embeddings are in CPU memory, and transformers all-reduces a flag made on the
    inputs' device (synced_gpus): the prompts go to the rank's training device (here the meta device, standing in
    for its GPU), never to where the base's parameters happen to be."""
    model, tokenizer = load_base_model(str(tiny_model), torch.float32, torch.device("cpu"))
    reft_model = build_reft_model(model, LAYERS, (2, 2), share_weights=False, low_rank_dimension=4)
    built_on = []

    def generate(self, base=None, **kwargs):  # the ReFT model's (a batch) or the base's (its inputs)
        built_on.append((base or kwargs)["input_ids"].device)
        raise InterruptedError  # the prompt's device is all this test asks

    monkeypatch.setattr(type(reft_model), "generate", generate)
    monkeypatch.setattr(type(model), "generate", generate)
    args = parse_args("train_multigpu.py", ["--num_sample_answers", "1"], multigpu=True)
    with pytest.raises(InterruptedError):
        sample_answers(reft_model, tokenizer, args, (2, 2), 2, torch.device("meta"), synced_ranks=True)
    assert built_on == [torch.device("meta")]


class Bound(Exception):
    """Raised in place of init_process_group, with the GPU it would bind the group to."""


@pytest.mark.parametrize("gpus, bound", [(1, "cuda:0"), (2, None)])
def test_a_rank_spanning_several_gpus_binds_its_process_group_to_none(monkeypatch, tiny_model, gpus, bound):
    """A process of one GPU binds NCCL to it (device_id); one spanning a --device_map of several binds none, since
    NCCL then takes only the bound GPU's tensors and DDP reduces each parameter on its own GPU (faked GPUs)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)

    def init_process_group(backend, **kwargs):
        raise Bound(None if kwargs.get("device_id") is None else str(kwargs["device_id"]))

    monkeypatch.setattr(torch.distributed, "init_process_group", init_process_group)
    with pytest.raises(Bound) as raised:
        run_in_process("train_multigpu.py", ["--model_name_or_path", tiny_model, "--device_map", "auto"])
    assert raised.value.args[0] == bound


def test_fsdp_offload_keeps_the_buffers_on_the_training_device(tiny_model, monkeypatch):
    """Offloaded shards stay in CPU memory (FSDP moves them for each forward), the buffers go to the training device
    (here meta, standing in for the GPU): FSDP moves no buffer, and a rotary table on the CPU would be copied over at
    every forward, or fail a model that uses a buffer where it is."""
    model = empty_base_model(str(tiny_model), torch.float32)
    placed_on = []
    monkeypatch.setattr(alpaca.sharding, "place_buffers",
                        lambda model, buffers, index, device: placed_on.append(device))
    load_shards(model, str(tiny_model), torch.device("meta"), offload=True)
    assert placed_on == [torch.device("meta")]
    assert {parameter.device for parameter in model.parameters()} == {torch.device("cpu")}


def test_the_zero2_config_allocates_buckets_for_the_trainable_values_only(tiny_model):
    """examples/deepspeed/zero2.json: DeepSpeed allocates its reduce bucket whole in float32, twice with
    overlap_comm; on Llama-3.1-8B's widths HF's "auto" (hidden size squared) is 128 MiB a rank and HF's 5e8 is
    4 GB, for a few thousand trainable values. One bucket holds them all."""
    args = parse_args("train_multigpu.py", ["--deepspeed", str(REPO / "examples" / "deepspeed" / "zero2.json")],
                      multigpu=True)
    config = args.deepspeed_config
    model = empty_base_model(str(tiny_model), torch.float32)
    model.config.hidden_size = 4096  # what "auto" reads
    trainable = 2 * (2 * 4096 * 4 + 4)  # LoReFT of rank 4 on two layers of that width
    fill_model_sized(config, model, trainable)
    zero = config["zero_optimization"]
    allocated = zero["reduce_bucket_size"] * 4 * (2 if zero["overlap_comm"] else 1)
    assert allocated <= 2 * 4 * trainable, allocated
