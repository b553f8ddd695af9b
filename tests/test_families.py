"""Decoder-only families whose module layout pyvene 0.1.8 does not know (it maps nine): their layout is found from
the model (`alpaca.workarounds.register_layout`). Tiny random models of each, built from the family's config."""

import json

import pytest
import torch
from conftest import (
    assert_reproduces_eval_loss,
    assert_same_run,
    build_tiny_model,
    eval_losses,
    run_in_process,
    torchrun,
    training_flags,
    write_records,
)

from alpaca.layers import decoder_layer_list
from alpaca.model import build_reft_model, load_base_model
from alpaca.output import read_metrics, save_interventions
from alpaca.workarounds import pyreft, register_layout

# family (its config class less 'Config'): the config's overrides and the intervention it trains with, so that
# each intervention runs on a new layout (LobiReFT barely moves the loss of a random model: LoReFT twice).
FAMILIES = {
    "Qwen3": ({"tie_word_embeddings": True}, "loreft"),
    "Gemma3Text": ({}, "noreft"),
    "Phi3": ({}, "direft"),
    "Olmo2": ({}, "nodireft"),
    "SmolLM3": ({}, "consreft"),
    "Granite": ({}, "loreft"),
}
# The causal LMs pyvene maps, by model_type.
PYVENE_FAMILIES = ["gpt2", "gpt_neo", "gpt_neox", "gemma", "gemma2", "llama", "mistral", "olmo", "qwen2"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    """The tiny model of a family of FAMILIES, built once."""
    built = {}

    def build(family: str):
        if family not in built:
            built[family] = build_tiny_model(tmp_path_factory.mktemp(family), family=family, **FAMILIES[family][0])
        return built[family]

    return build


def meta_model(model_type: str, **config):
    """The causal LM transformers builds for `model_type`'s default config, on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **config))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_loads_back_and_generates(family, family_model, tmp_path):
    """2 steps on one batch of 4 (with gradient checkpointing and a sample answer) lower the loss; the saved
    interventions, loaded back, give the eval loss the run logged; examples/generate.py answers with them."""
    model_dir, output = family_model(family), tmp_path / "out"
    data = write_records(tmp_path / "data.json", 4)
    status, stdout, stderr = run_in_process("train.py", training_flags(
        model_dir, data, output, "--eval_data_path", data, "--intervention", FAMILIES[family][1], "--position", "f2+l2",
        "--rank", "4", "--per_device_train_batch_size", "4", "--max_steps", "2", "--learning_rate", "2e-2",
        "--logging_steps", "1", "--eval_strategy", "steps", "--eval_steps", "2", "--gradient_checkpointing",
        "--num_sample_answers", "1", "--max_new_tokens", "4"))
    assert status == 0, stderr[-3000:]
    assert "REFT MODEL" in stdout
    losses = [record["loss"] for record in read_metrics(output) if "loss" in record]
    assert len(losses) == 2 and losses[1] < losses[0], losses
    records = json.loads(data.read_text())
    assert_reproduces_eval_loss(eval_losses(output)[2], output, model_dir, records)
    status, stdout, stderr = run_in_process("examples/generate.py", ["--reft_dir", output, "--instruction",
                                                                     "Name three primary colors.",
                                                                     "--max_new_tokens", "4"])
    assert status == 0, stderr[-3000:]
    assert "REFT MODEL" in stdout


def test_pyreft_loads_a_family_it_does_not_know_once_its_layout_is_registered(family_model, tmp_path, monkeypatch):
    """pyreft's `ReftModel.load` builds the model through pyvene, whose tables lack Qwen3: it fails until
    `register_layout(base)` has run (as training runs it); then it gives the saved model's outputs, up to the
    rounding of the float32 learned source to bf16 that pyreft's loader makes."""
    import pyvene

    model, tokenizer = load_base_model(str(family_model("Qwen3")), torch.bfloat16, CPU)
    torch.manual_seed(0)
    trained = build_reft_model(model, "1;2", (1, 1), False, low_rank_dimension=4)
    save_interventions(trained, tmp_path)
    for table in (pyvene.type_to_module_mapping, pyvene.type_to_dimension_mapping):
        monkeypatch.delitem(table, type(model))  # as in a fresh process
    with pytest.raises(KeyError):
        pyreft.ReftModel.load(str(tmp_path), model)

    register_layout(model)
    loaded = pyreft.ReftModel.load(str(tmp_path), model)
    ids = torch.tensor([tokenizer("Name three primary colors.")["input_ids"]])
    locations = {"sources->base": (None, [[[0]], [[0]], [[ids.shape[1] - 1]], [[ids.shape[1] - 1]]])}
    with torch.no_grad():
        expected = trained({"input_ids": ids}, unit_locations=locations)[1].logits
        actual = loaded({"input_ids": ids}, unit_locations=locations)[1].logits
    assert (actual - expected).abs().max() <= 0.05 * expected.abs().max()


@pytest.mark.parametrize("model_type", PYVENE_FAMILIES)
def test_the_layout_found_for_a_family_pyvene_maps_is_pyvene_s(model_type):
    """The decoder layer list and hidden size found from the model are those of pyvene's own table, which
    register_layout leaves untouched."""
    import pyvene
    from pyvene.models.modeling_utils import get_dimension_by_component

    model = meta_model(model_type)
    pyvene_layout = pyvene.type_to_module_mapping[type(model)]
    assert pyvene_layout["block_output"] == (f"{decoder_layer_list(model)}[%s]", "register_forward_hook")
    assert get_dimension_by_component(type(model), model.config, "block_output") == model.config.hidden_size
    register_layout(model)
    assert pyvene.type_to_module_mapping[type(model)] is pyvene_layout


def test_a_multimodal_model_is_intervened_on_in_its_language_model():
    """Gemma 3 from 4B on is Gemma3ForConditionalGeneration: a vision tower has a layer list too, and the width
    is the text config's."""
    import pyvene
    from pyvene.models.modeling_utils import get_dimension_by_component

    model = meta_model("gemma3", text_config={"hidden_size": 96})
    register_layout(model)
    assert pyvene.type_to_module_mapping[type(model)]["block_output"][0] == "model.language_model.layers[%s]"
    assert get_dimension_by_component(type(model), model.config, "block_output") == 96


@pytest.mark.parametrize("model_type", ["qwen3", "phi3"])
def test_the_layout_registered_has_every_component(model_type):
    """--component mlp_output and attention_output of a family pyvene does not map: its layers' `mlp` and
    `self_attn`, as wide as the hidden state."""
    import pyvene
    from pyvene.models.modeling_utils import get_dimension_by_component

    from alpaca.constants import COMPONENTS

    model = meta_model(model_type)
    register_layout(model)
    layout = pyvene.type_to_module_mapping[type(model)]
    layers = decoder_layer_list(model)
    assert layout["mlp_output"][0] == f"{layers}[%s].mlp" and layout["attention_output"][0] == f"{layers}[%s].self_attn"
    for component in COMPONENTS:
        model.get_submodule(layout[component][0].replace("[%s]", ".0"))  # the module pyvene hooks exists
        assert get_dimension_by_component(type(model), model.config, component) == model.config.hidden_size


def test_a_model_without_a_decoder_layer_list_or_with_a_larger_tokenizer_is_refused_before_loading(tiny_model,
                                                                                                   tmp_path):
    """One line, exit 2, from the config and tokenizer alone: the models have no weights file."""
    from transformers import AutoTokenizer

    data = write_records(tmp_path / "data.json", 4)
    no_layer_list = build_tiny_model(tmp_path / "openai-gpt", family="OpenAIGPT")
    too_small = build_tiny_model(tmp_path / "small-vocab", vocab_size=300)
    for model_dir, message in [
        (no_layer_list, "OpenAIGPTLMHeadModel has no list of decoder layers (a ModuleList of its _no_split_modules "
                        "blocks), where the interventions act; pass a decoder-only causal LM"),
        (too_small, f"the tokenizer of '{too_small}' has {len(AutoTokenizer.from_pretrained(too_small))} tokens, "
                    "its model's embedding matrix 300 rows: they do not belong together; pass a model directory "
                    "that holds both"),
    ]:
        (model_dir / "model.safetensors").unlink()
        status, _, stderr = run_in_process("train.py", training_flags(model_dir, data, tmp_path / "out"))
        assert status == 2, stderr[-3000:]
        assert stderr.strip().splitlines()[-1].startswith("train.py: error: ") and message in stderr, stderr[-3000:]
        assert "Traceback" not in stderr


def test_fsdp_trains_a_new_family_as_ddp(family_model, tmp_path):
    """Qwen3, tied embeddings, on 2 ranks: --fsdp (its sharded load, decoder layers as units, sample answers
    from the sharded base) trains the same model as DDP, bit for bit."""
    data = write_records(tmp_path / "data.json", 12)
    common = ["train_multigpu.py", *training_flags(family_model("Qwen3"), data, None, "--position", "f2+l2", "--rank",
                                                   "4", "--learning_rate", "1e-2", "--max_steps", "3",
                                                   "--per_device_train_batch_size", "2", "--logging_steps", "1")]
    ddp = torchrun(2, [*common, "--output_dir", tmp_path / "ddp", "--num_sample_answers", "0"])
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    fsdp = torchrun(2, [*common, "--output_dir", tmp_path / "fsdp", "--fsdp", "--num_sample_answers", "1",
                        "--max_new_tokens", "4"])
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    assert "REFT MODEL" in fsdp.stdout
    assert_same_run(tmp_path / "fsdp", tmp_path / "ddp", exact=True)
