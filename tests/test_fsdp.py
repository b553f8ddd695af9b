"""train_multigpu.py --fsdp (FSDP2 over the frozen base, gloo on CPU) and --gradient_checkpointing."""

import json
import shutil

import pytest
import torch
from conftest import (
    FAULTS,
    REPO,
    assert_reproduces_eval_loss,
    assert_same_run,
    assert_within_rounding,
    eval_losses,
    flags,
    rounding_tolerances,
    run_in_process,
    torchrun,
    training_flags,
)

from alpaca.checkpoint import checkpoints
from alpaca.model import enable_gradient_checkpointing, load_base_model


def test_fsdp_trains_the_same_model_as_ddp(fsdp_runs):
    """Bit-identical: the same sums, as DDP, over the same two ranks."""
    root, _ = fsdp_runs
    assert_same_run(root / "fsdp", root / "ddp", exact=True)


def test_fsdp_reports_the_eval_loss_of_one_process(fsdp_runs):
    """Rank 1 holds one eval batch fewer than rank 0 and still joins each of rank 0's sharded forwards."""
    root, _ = fsdp_runs
    single, fsdp = eval_losses(root / "single"), eval_losses(root / "fsdp")
    assert single.keys() == fsdp.keys() == {4, 8, 9}
    assert fsdp == pytest.approx(single, rel=rounding_tolerances(root / "single")["eval_loss"], abs=0)


def test_fsdp_prints_sample_answers_of_the_trained_model(fsdp_runs):
    """Generation under FSDP: every rank runs each forward of the sharded base; rank 0 prints."""
    _, result = fsdp_runs
    assert result.stdout.count("Instruction: ") == 2
    assert "BASE MODEL" in result.stdout and "REFT MODEL" in result.stdout


def test_fsdp_holds_about_half_the_base_per_rank_on_two_ranks(fsdp_runs):
    def base_bytes(name):
        return json.loads((fsdp_runs[0] / name / "training_args.json").read_text())["base_parameter_bytes_per_rank"]

    assert base_bytes("fsdp") <= 0.6 * base_bytes("ddp")


@pytest.mark.fast
def test_gradient_checkpointing_recomputes_each_layer(tiny_model):
    """The layers that backward goes through (above the lowest intervention, layer 1) run twice per step:
    forward, then again in backward. The gradients are those without checkpointing."""
    from alpaca.layers import decoder_layers
    from alpaca.model import build_reft_model

    def step(checkpointing, dtype=torch.float32):
        model, _ = load_base_model(str(tiny_model), dtype, torch.device("cpu"))
        if checkpointing:
            enable_gradient_checkpointing(model)
        calls = []
        for index, layer in enumerate(decoder_layers(model)):
            layer.register_forward_pre_hook(lambda module, args, index=index: calls.append(index))
        torch.manual_seed(0)
        reft_model = build_reft_model(model, "1;3", (1, 1), False, low_rank_dimension=4)
        ids = torch.randint(0, 300, (2, 12))
        locations = [[[0], [0]]] * 2 + [[[11], [11]]] * 2
        _, outputs = reft_model({"input_ids": ids}, unit_locations={"sources->base": (None, locations)})
        outputs.logits.logsumexp(-1).sum().backward()
        return sorted(calls), [p.grad for p in reft_model.interventions.parameters()]

    plain_calls, plain_grads = step(False)
    checkpointed_calls, checkpointed_grads = step(True)
    assert plain_calls == [0, 1, 2, 3] and checkpointed_calls == [0, 1, 2, 2, 3, 3]
    assert_within_rounding(checkpointed_grads, plain_grads, step(False, torch.float64)[1])


def test_fsdp_output_reproduces_its_eval_loss_in_one_process(fsdp_runs, tiny_tied_model, tiny_eval_data):
    """The interventions rank 0 saved, loaded with pyreft's loader in a plain process, give the eval loss the
    sharded run logged after its last step."""
    root, _ = fsdp_runs
    final = eval_losses(root / "fsdp")[9]
    records = json.loads(tiny_eval_data.read_text())
    assert_reproduces_eval_loss(final, root / "fsdp", tiny_tied_model, records)


def test_fsdp_resume_from_an_end_of_epoch_checkpoint_after_a_killed_rank(tiny_model, tiny_data, tmp_path, reference):
    """Rank 1 killed in step 7 of a run under --fsdp --gradient_checkpointing (2 processes x 2 accumulation), so
    checkpoint-6 (the end of epoch 2) is the newest. The last global batch of each epoch holds one example, so
    rank 1's micro-batches are all empty there: it must still run every sharded forward. Resumed from it by the
    same launch; and, from a copy without it, from checkpoint-4 (inside epoch 2) by one process of train.py
    with the same global batch (x 4 accumulation; x 2 is refused). Both give the model of one uninterrupted
    process, the launch resumed with --packing too (every rank runs the most packs of any rank, rank 1 a
    placeholder where it has none). Without dropout, whose streams differ between 1 and 2 processes."""
    single = flags(tiny_model, tiny_data, tmp_path / "one", "--dropout", "0")
    args = ["train_multigpu.py", *flags(tiny_model, tiny_data, tmp_path / "two", "--gradient_accumulation_steps", "2",
                                        "--dropout", "0", "--fsdp", "--gradient_checkpointing")]
    killed = torchrun(2, [FAULTS, *args], env={"FAULT": "kill", "FAULT_STEP": "7", "FAULT_RANK": "1"})
    assert killed.returncode != 0
    assert [path.name for path in checkpoints(tmp_path / "two")] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    shutil.copytree(tmp_path / "two", tmp_path / "one", ignore=shutil.ignore_patterns("checkpoint-6"))

    status, _, stderr = run_in_process("train.py", [*single, "--gradient_accumulation_steps", "2",
                                                    "--resume_from_checkpoint", "auto"])
    assert status == 2
    assert ("global batch 8 = 2 per device x 2 processes x 2 accumulation, this run has global batch 4 = 2 per "
            "device x 1 processes x 2 accumulation") in stderr
    status, stdout, stderr = run_in_process("train.py", [*single, "--gradient_accumulation_steps", "4",
                                                         "--resume_from_checkpoint", "auto"])
    assert status == 0, stderr[-3000:]
    assert "at step 4" in stdout
    assert_same_run(tmp_path / "one", reference / "single-no-dropout")

    resumed = torchrun(2, [*args, "--resume_from_checkpoint", "auto", "--packing"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 6" in resumed.stdout
    assert "packed into micro-batches of up to 1024 tokens" in resumed.stdout  # the default: 2 per device x 512
    assert_same_run(tmp_path / "two", reference / "single-no-dropout")


def test_sharded_load_gives_the_checkpoints_weights(tmp_path):
    """--fsdp's load and ZeRO-3's on 3 ranks: built on meta, sharded (partitioned), each rank reading its slices
    of the safetensors file. The gathered weights, buffers and logits are those of the model loaded whole, with
    untied and with tied embeddings (which stay one parameter); every sharded dimension (301 vocabulary rows, 64
    and 128 hidden) splits unevenly over 3 ranks, and so do ZeRO-3's flat partitions and a 4-bit base's packed
    weights (its bytes and constants those transformers quantizes). A ZeRO-3 rank holds and
    has read only its partitions. (Two ranks load this way in every --fsdp and ZeRO-3 run of the tests.)"""
    from transformers import LlamaConfig, LlamaForCausalLM

    for tied in (False, True):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                             initializer_range=0.3)
        LlamaForCausalLM(config).save_pretrained(tmp_path / f"tied-{tied}")
    result = torchrun(3, [str(REPO / "tests" / "sharded_load.py"), str(tmp_path / "tied-False"),
                          str(tmp_path / "tied-True")])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ok: 3 ranks, tied=False" in result.stdout and "ok: 3 ranks, tied=True" in result.stdout
    assert "ok: 4-bit, 3 ranks, tied=False" in result.stdout and "ok: 4-bit, 3 ranks, tied=True" in result.stdout
    assert "ok: ZeRO-3, 3 ranks, tied=False" in result.stdout and "ok: ZeRO-3, 3 ranks, tied=True" in result.stdout


@pytest.mark.parametrize("strategy", [["--fsdp"], ["--deepspeed", str(REPO / "examples" / "deepspeed" / "zero3.json")]],
                         ids=["fsdp", "zero3"])
def test_fsdp_and_zero3_need_safetensors(tiny_model, tiny_data, tmp_path, monkeypatch, strategy):
    """Both read each rank's part of the base from safetensors files: a model without them is refused in one
    line, before any weight loads."""
    import alpaca.strategy

    # glibc's threshold, once fixed, stays so for this test process: the refusal does not need it
    monkeypatch.setattr(alpaca.strategy, "return_freed_buffers_to_the_os", lambda: None)
    reader = "--fsdp" if strategy == ["--fsdp"] else "ZeRO-3"
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for file in tiny_model.iterdir():
        if file.suffix != ".safetensors":
            (model_dir / file.name).write_bytes(file.read_bytes())
    status, _, stderr = run_in_process("train_multigpu.py", training_flags(model_dir, tiny_data, tmp_path / "out",
                                                                           *strategy))
    assert status == 2, stderr[-3000:]
    assert f"{reader} reads each rank's shards from safetensors files" in stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


@pytest.mark.fast
@pytest.mark.parametrize("strategy,fixed", [
    (["--fsdp"], True), (["--deepspeed", str(REPO / "examples" / "deepspeed" / "zero3.json")], True),
    (["--deepspeed", str(REPO / "examples" / "deepspeed" / "zero2.json")], False), ([], False)],
    ids=["fsdp", "zero3", "zero2", "ddp"])
def test_sharded_strategies_fix_glibcs_mmap_threshold_as_they_are_chosen(monkeypatch, strategy, fixed):
    """On a CPU, --fsdp and ZeRO-3 fix it before the data and the model load: fixed later, a heap grown meanwhile
    can keep a tenth of a model copy more on a rank (docs/big-models.md). The replicated strategies leave
    glibc's adaptive threshold."""
    import alpaca.strategy
    from alpaca.args import parse_args

    calls = []
    monkeypatch.setattr(alpaca.strategy, "return_freed_buffers_to_the_os", lambda: calls.append("fixed"))
    args = parse_args("train_multigpu.py", strategy, multigpu=True)
    alpaca.strategy.choose_strategy(args, torch.device("cpu"), torch.float32, [])
    assert calls == (["fixed"] if fixed else [])
