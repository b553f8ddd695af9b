"""Every intervention pyreft ships for a block's output: offered, trained, saved in pyreft's format and loaded
back with the same outputs."""

import inspect

import pytest
import torch
from conftest import (
    NOISE_MARGIN,
    assert_within_rounding,
    intervention_weights,
    loss_and_gradients,
    relative_deviation,
    run_in_process,
    training_flags,
    write_records,
)

from alpaca.args import parse_args
from alpaca.collate import Collator
from alpaca.constants import INTERVENTIONS
from alpaca.data import load_records, tokenize
from alpaca.loss import summed_token_loss
from alpaca.model import build_reft_model, intervention_parameters, load_base_model
from alpaca.optim import optimizer_param_groups
from alpaca.output import load_reft_model, save_interventions
from alpaca.workarounds import pyreft, trainable_dtype

POSITION = (3, 3)
CPU = torch.device("cpu")


def base_model_loss(model, batch) -> torch.Tensor:
    """The base model's own summed loss on the batch's labels, without interventions, in float64."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    return torch.nn.functional.cross_entropy(logits.double().transpose(1, 2), batch["labels"][:, 1:],
                                             reduction="sum").view(1)


@pytest.mark.fast
def test_every_block_output_intervention_of_pyreft_is_offered():
    from pyvene import SourcelessIntervention, TrainableIntervention

    shipped = {name for name, cls in inspect.getmembers(pyreft.interventions, inspect.isclass)
               if cls.__module__ == "pyreft.interventions" and issubclass(cls, TrainableIntervention)
               and issubclass(cls, SourcelessIntervention)}
    assert {f"pyreft.interventions.{name}" for name in shipped} == set(INTERVENTIONS.values())


@pytest.mark.parametrize("intervention", list(INTERVENTIONS))
def test_each_intervention_trains_and_reloads_with_the_same_outputs(tiny_model, tiny_data, tmp_path, intervention):
    """Fifteen AdamW steps with weight decay on one batch lower the loss, and every rotation stays orthonormal
    (left to weight decay, it would be zeroed at the first step and the loss would go flat). The saved
    directory then loads back: in float32 with the same loss, on a bfloat16 base with the interventions in float32."""
    model, tokenizer = load_base_model(str(tiny_model), torch.float32, CPU)
    torch.manual_seed(0)
    reft_model = build_reft_model(model, "all", POSITION, False, low_rank_dimension=4, intervention=intervention)
    batch = Collator(tokenizer.pad_token_id, POSITION, False, num_layers=4)(
        list(tokenize(load_records(str(tiny_data)), tokenizer, 512))[:7])
    optimizer = torch.optim.AdamW(optimizer_param_groups(reft_model, weight_decay=0.1), lr=3e-2)
    losses = []
    for _ in range(15):
        loss = summed_token_loss(reft_model, batch, CPU) / batch["num_label_tokens"]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < min(losses[:5]), losses
    # LobiReFT (h + R^T b) only adds a learned vector: on the tiny random model it moves the loss by 0.3 %.
    assert intervention == "lobireft" or losses[-1] < 0.95 * losses[0], losses
    rotations = [p for name, p in intervention_parameters(reft_model) if ".parametrizations." in name]
    assert bool(rotations) == (intervention in ("loreft", "direft", "lobireft", "consreft"))
    for intervention_module in reft_model.interventions.values():
        if hasattr(intervention_module, "rotate_layer"):
            rotation = intervention_module.rotate_layer.weight
            # each entry a float32 dot product of `hidden` terms: within hidden x 2^-24 of the exact one (the
            # classic bound), as is the orthogonalization that built the rotation; weight decay moves it by ~1
            hidden = rotation.shape[0]
            torch.testing.assert_close(rotation.T @ rotation, torch.eye(4), atol=NOISE_MARGIN * hidden * 2**-24,
                                       rtol=0)

    reft_model.interventions.eval()
    with torch.no_grad():
        expected = summed_token_loss(reft_model, batch, CPU)
    save_interventions(reft_model, tmp_path)
    base_losses, reloaded_losses = {}, {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        base, _ = load_base_model(str(tiny_model), dtype, CPU)
        reloaded = load_reft_model(tmp_path, base)
        loaded_class = type(next(iter(reloaded.interventions.values())))
        assert f"{loaded_class.__module__}.{loaded_class.__name__}" == INTERVENTIONS[intervention]
        assert all(p.dtype == trainable_dtype(dtype) for p in reloaded.interventions.parameters())
        with torch.no_grad():
            reloaded_losses[dtype] = summed_token_loss(reloaded, batch, CPU).double().view(1)
            base_losses[dtype] = base_model_loss(base, batch)
    # the same saved weights: the loss within float32 rounding (measured against the float64 base) ...
    assert_within_rounding([reloaded_losses[torch.float32]], [expected.double().view(1)],
                           [reloaded_losses[torch.float64]])
    # ... and on a bf16 base within bf16's rounding of this batch, measured on the base model alone (the float32
    # interventions add none of their own); no bf16 value is nearer its truth than 2^-9
    bf16_error = relative_deviation(base_losses[torch.bfloat16], base_losses[torch.float32])
    deviation = relative_deviation(reloaded_losses[torch.bfloat16], expected.double().view(1))
    assert deviation <= NOISE_MARGIN * max(bf16_error, 2**-9), (deviation, bf16_error)


@pytest.mark.parametrize("intervention", ["loreft", "noreft"])
def test_a_bf16_run_at_a_small_learning_rate_changes_every_learned_entry(tiny_model, tmp_path, intervention):
    """train.py on a bf16 base for 15 steps at a constant 2e-5 (the learning rate of pyreft's command line)
    against the same run at 1e-30 (0 is refused; AdamW's steps of ~1e-30 move no float32 entry): every entry
    of every learned tensor of every intervention differs. (With the
    learned source in bf16, as pyreft builds it, 3-8 % of its weight's entries and 0-25 % of its bias's moved:
    AdamW's steps of ~2e-5 fall below half a bf16 spacing and round away.) LoReFT: the learned source and the
    rotation; NoReFT: the learned source and the projection, each with its bias."""
    data = write_records(tmp_path / "data.json", 12)
    weights = {}
    for learning_rate in ("2e-5", "1e-30"):
        output = tmp_path / learning_rate
        status, _, stderr = run_in_process("train.py", training_flags(
            tiny_model, data, output, "--dtype", "bfloat16", "--intervention", intervention, "--learning_rate",
            learning_rate, "--lr_scheduler_type", "constant", "--max_steps", "15", "--per_device_train_batch_size",
            "4", "--num_sample_answers", "0"))
        assert status == 0, stderr[-3000:]
        weights[learning_rate] = {key: tensor for key, tensor in intervention_weights(output).items()
                                  if tensor.is_floating_point()}
    assert len(weights["1e-30"]) == 4 * (3 if intervention == "loreft" else 4)  # f and l on 2 layers
    for key, untrained in weights["1e-30"].items():
        assert weights["2e-5"][key].dtype == torch.float32, key
        assert (weights["2e-5"][key] != untrained).all(), (key, (weights["2e-5"][key] == untrained).float().mean())


def test_noreft_trains_end_to_end_and_generate_loads_it(tiny_model, tmp_path):
    """NoReFT needs `add_bias`, which pyreft's own loader cannot know (KeyError: 'add_bias')."""
    output = tmp_path / "out"
    status, _, stderr = run_in_process("train.py", training_flags(
        tiny_model, write_records(tmp_path / "data.json", 6), output, "--intervention", "noreft", "--max_steps", "2",
        "--num_sample_answers", "0"))
    assert status == 0, stderr[-3000:]
    status, stdout, stderr = run_in_process("examples/generate.py", ["--reft_dir", output, "--instruction",
                                                                     "Name three primary colors.",
                                                                     "--max_new_tokens", "4"])
    assert status == 0, stderr[-3000:]
    assert "REFT MODEL" in stdout


@pytest.mark.fast
def test_share_weights_with_only_first_or_last_positions_says_it_changes_nothing(capsys):
    parse_args("train.py", ["--position", "l3", "--share_weights"])
    assert "--position l3 has only one of them, so it changes nothing" in capsys.readouterr().err
    parse_args("train.py", ["--position", "f1+l1", "--share_weights"])
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("component", ["mlp_output", "attention_output"])
def test_each_component_is_intervened_on_saved_and_loaded_back(tiny_model, tiny_data, tmp_path, component):
    """--component: the interventions act there (another loss than on the block output), the on-device write
    gives pyvene's own losses and gradients exactly, and the loader reads the component back from config.json."""
    model, tokenizer = load_base_model(str(tiny_model), torch.float32, CPU)
    batch = Collator(tokenizer.pad_token_id, POSITION, False, num_layers=2)(
        list(tokenize(load_records(str(tiny_data)), tokenizer, 512))[:5])

    def built(component):
        torch.manual_seed(0)
        reft_model = build_reft_model(model, "1;2", POSITION, False, low_rank_dimension=4, component=component)
        for intervention in reft_model.interventions.values():
            torch.nn.init.normal_(intervention.learned_source.weight, std=0.3)
        return reft_model

    block_loss, _ = loss_and_gradients(built("block_output"), batch)
    reft_model = built(component)
    ours_loss, ours = loss_and_gradients(reft_model, batch)
    assert not torch.allclose(ours_loss, block_loss)
    del reft_model._scatter_intervention_output  # back to pyvene's method
    pyvenes_loss, pyvenes = loss_and_gradients(reft_model, batch)
    assert torch.equal(ours_loss, pyvenes_loss)
    assert all(torch.equal(actual, expected) for actual, expected in zip(ours, pyvenes))

    save_interventions(reft_model, tmp_path)
    reloaded_losses = {}
    for dtype in (torch.float32, torch.float64):  # the loss within float32 rounding, measured on a float64 base
        fresh, _ = load_base_model(str(tiny_model), dtype, CPU)
        reloaded = load_reft_model(tmp_path, fresh)
        assert {representation.component for representation in reloaded.representations.values()} == {component}
        with torch.no_grad():
            reloaded_losses[dtype] = summed_token_loss(reloaded, batch, CPU).double().view(1)
    assert_within_rounding([reloaded_losses[torch.float32]], [ours_loss.double().view(1)],
                           [reloaded_losses[torch.float64]])
