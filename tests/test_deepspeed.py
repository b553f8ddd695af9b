"""train_multigpu.py --deepspeed CONFIG.json (ZeRO-1 and ZeRO-2, gloo on CPU): the model DDP trains, and clear
errors for configs that cannot work."""

import json

import pytest
import torch
from conftest import REPO, assert_same_run, intervention_weights, run_script, torchrun

from alpaca.model import load_base_model
from alpaca.output import load_reft_model, read_metrics

ZERO2 = REPO / "examples" / "deepspeed" / "zero2.json"


def config_file(directory, **changes):
    config = json.loads(ZERO2.read_text())
    config["zero_optimization"].update(changes.pop("zero_optimization", {}))
    config.update(changes)
    path = directory / "ds_config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_trains_the_same_model_as_ddp(runs, tmp_path, tiny_model, stage):
    """The DDP run of test_multigpu (accumulation 2, a partial last global batch where rank 1's last micro-batch
    is empty, eval every 4 steps), under ZeRO: the same weights, losses, eval losses and per-step gradient
    norms (which a constant factor in the gradient would change, though AdamW hides it from the weights)."""
    root, data = runs
    result = torchrun(2, ["train_multigpu.py", *data, "--output_dir", str(tmp_path / "out"),
                          "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
                          "--deepspeed", str(config_file(tmp_path, zero_optimization={"stage": stage}))])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"DeepSpeed ZeRO-{stage}" in result.stdout
    assert_same_run(tmp_path / "out", root / "ddp")
    assert len([r for r in read_metrics(tmp_path / "out") if "grad_norm" in r]) == 9

    base, _ = load_base_model(str(tiny_model), torch.float32, torch.device("cpu"))
    reft_model = load_reft_model(tmp_path / "out", base)
    saved = intervention_weights(tmp_path / "out")
    for key, intervention in reft_model.interventions.items():
        assert torch.equal(intervention.rotate_layer.weight, saved[f"intkey_{key}.bin/rotate_layer"])


BAD_CONFIGS = [
    # (name, config text or None for a missing file, extra flags, what stderr must say)
    ("missing file", None, [], "cannot read it"),
    ("invalid json", '{"zero_optimization": {"stage": 2},}', [], "invalid JSON at line 1"),
    ("stage 7", json.dumps({"zero_optimization": {"stage": 7}}), [], "stage 7 does not exist here; use 1 or 2"),
    ("stage 3", json.dumps({"zero_optimization": {"stage": 3}}), [], "ZeRO-3 is not supported yet"),
    ("micro-batch", json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}), [],
     "train_micro_batch_size_per_gpu 4 disagrees with --per_device_train_batch_size (2)"),
    ("optimizer", json.dumps({"zero_optimization": {"stage": 2},
                              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "eps": "auto"}}}), [],
     'optimizer {"lr": 0.0003}: the optimizer comes from --learning_rate'),
    ("offload on cpu", json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}), [],
     "offload_optimizer moves state from GPUs to the CPU"),
    ("with fsdp", ZERO2.read_text(), ["--fsdp"], "--fsdp and --deepspeed are exclusive"),
    ("checkpoints", ZERO2.read_text(), ["--save_strategy", "steps"], "does not save or resume checkpoints yet"),
]


@pytest.mark.parametrize("name,text,extra,message", BAD_CONFIGS, ids=[case[0] for case in BAD_CONFIGS])
def test_bad_deepspeed_config(tiny_model, tiny_data, tmp_path, name, text, extra, message):
    config = tmp_path / "ds.json"
    if text is not None:
        config.write_text(text)
    output_dir = tmp_path / "out"
    result = run_script(["train_multigpu.py", "--model_name_or_path", str(tiny_model), "--data_path", str(tiny_data),
                         "--output_dir", str(output_dir), "--per_device_train_batch_size", "2", "--layers", "1;2",
                         "--deepspeed", str(config), *extra])
    assert result.returncode == 2, result.stderr[-3000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert not output_dir.exists()
