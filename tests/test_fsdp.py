"""train_multigpu.py --fsdp (FSDP2 over the frozen base, gloo on CPU) and --gradient_checkpointing."""

import json

import pytest
import torch
from conftest import FAULTS, REPO, assert_same_model, eval_losses, flags, intervention_weights, run_script, torchrun

from alpaca.model import enable_gradient_checkpointing, load_base_model


@pytest.fixture(scope="module")
def fsdp_runs(runs):
    """The DDP run of test_multigpu, again with --fsdp, and both with --gradient_checkpointing."""
    root, data = runs
    common = [*data, "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"]
    for name, extra in [("fsdp", ["--fsdp"]), ("fsdp-gc", ["--fsdp", "--gradient_checkpointing"]),
                        ("ddp-gc", ["--gradient_checkpointing"])]:
        result = torchrun(2, ["train_multigpu.py", *common, "--output_dir", str(root / name), *extra])
        assert result.returncode == 0, result.stderr[-3000:]
    return root


def test_fsdp_trains_the_same_model_as_ddp(fsdp_runs):
    assert_same_model(fsdp_runs / "fsdp", fsdp_runs / "ddp")


def test_fsdp_reports_the_eval_loss_of_one_process(fsdp_runs):
    """Rank 1 holds one eval batch fewer than rank 0 and still joins each of rank 0's sharded forwards."""
    single, fsdp = eval_losses(fsdp_runs / "single"), eval_losses(fsdp_runs / "fsdp")
    assert single.keys() == fsdp.keys() == {4, 8, 9}
    for step in single:
        assert abs(fsdp[step] - single[step]) <= 1e-5, step


def test_fsdp_holds_about_half_the_base_per_rank_on_two_ranks(fsdp_runs):
    def base_bytes(name):
        return json.loads((fsdp_runs / name / "training_args.json").read_text())["base_parameter_bytes_per_rank"]

    assert base_bytes("fsdp") <= 0.6 * base_bytes("ddp")


@pytest.mark.parametrize("name,reference", [("fsdp-gc", "fsdp"), ("ddp-gc", "ddp")])
def test_gradient_checkpointing_gives_the_same_model(fsdp_runs, name, reference):
    assert_same_model(fsdp_runs / name, fsdp_runs / reference)


def test_gradient_checkpointing_recomputes_each_layer(tiny_model):
    """The layers that backward goes through (above the lowest intervention, layer 1) run twice per step:
    forward, then again in backward. The gradients are those without checkpointing."""
    from alpaca.model import build_reft_model, decoder_layers

    def step(checkpointing):
        model, _ = load_base_model(str(tiny_model), torch.float32, torch.device("cpu"))
        if checkpointing:
            enable_gradient_checkpointing(model)
        calls = []
        for index, layer in enumerate(decoder_layers(model)):
            layer.register_forward_pre_hook(lambda module, args, index=index: calls.append(index))
        torch.manual_seed(0)
        reft_model = build_reft_model(model, "1;3", (1, 1), False, rank=4)
        ids = torch.randint(0, 300, (2, 12))
        locations = [[[0], [0]]] * 2 + [[[11], [11]]] * 2
        _, outputs = reft_model({"input_ids": ids}, unit_locations={"sources->base": (None, locations)})
        outputs.logits.logsumexp(-1).sum().backward()
        return sorted(calls), [p.grad for p in reft_model.interventions.parameters()]

    plain_calls, plain_grads = step(False)
    checkpointed_calls, checkpointed_grads = step(True)
    assert plain_calls == [0, 1, 2, 3] and checkpointed_calls == [0, 1, 2, 2, 3, 3]
    for expected, actual in zip(plain_grads, checkpointed_grads):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-7)


def test_fsdp_output_loads_in_pyreft_in_one_process(fsdp_runs, tiny_model):
    import pyreft

    base, _ = load_base_model(str(tiny_model), torch.float32, torch.device("cpu"))
    reft_model = pyreft.ReftModel.load(str(fsdp_runs / "fsdp"), base)
    saved = intervention_weights(fsdp_runs / "fsdp")
    for key, intervention in reft_model.interventions.items():
        assert torch.equal(intervention.rotate_layer.weight, saved[f"intkey_{key}.bin/rotate_layer"])


def test_fsdp_resume_after_a_killed_rank(tiny_model, tiny_data, tmp_path, reference):
    """Killed at step 6, resumed from checkpoint-4, under --fsdp: the model of the uninterrupted DDP run."""
    args = ["train_multigpu.py", *flags(tiny_model, tiny_data, tmp_path, "--gradient_accumulation_steps",
                                               "2", "--fsdp")]
    killed = torchrun(2, [FAULTS, *args], env={"FAULT": "kill", "FAULT_STEP": "6", "FAULT_RANK": "1"})
    assert killed.returncode != 0
    resumed = torchrun(2, [*args, "--resume_from_checkpoint", "auto"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 4" in resumed.stdout
    assert_same_model(tmp_path, reference / "ddp")


def test_fsdp_offload_needs_cuda(tiny_model, tiny_data, tmp_path):
    result = run_script(["train_multigpu.py", "--model_name_or_path", str(tiny_model), "--data_path", str(tiny_data),
                         "--output_dir", str(tmp_path), "--fsdp", "full_shard offload", "--layers", "1;2"])
    assert result.returncode == 2
    assert "--fsdp offload keeps the shards in CPU memory for GPUs" in result.stderr


@pytest.mark.parametrize("nproc,tied", [(2, False), (4, True)])
def test_sharded_load_gives_the_checkpoints_weights(tmp_path, nproc, tied):
    """--fsdp's load: built on meta, sharded, each rank reading its slices of the safetensors file. The gathered
    weights, buffers and logits are those of the model loaded whole; tied embeddings stay one parameter;
    301 vocabulary rows split unevenly over the ranks."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                         initializer_range=0.3)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    result = torchrun(nproc, [str(REPO / "tests" / "sharded_load.py"), str(tmp_path)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"ok: {nproc} ranks, tied={tied}" in result.stdout


def test_fsdp_needs_safetensors(tiny_model, tiny_data, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    for file in tiny_model.iterdir():
        if file.suffix != ".safetensors":
            (model_dir / file.name).write_bytes(file.read_bytes())
    result = run_script(["train_multigpu.py", "--model_name_or_path", str(model_dir), "--data_path", str(tiny_data),
                         "--output_dir", str(tmp_path / "out"), "--fsdp", "--layers", "1;2"])
    assert result.returncode == 2, result.stderr[-3000:]
    assert "--fsdp reads each rank's shards from safetensors files" in result.stderr
    assert "Traceback" not in result.stderr
