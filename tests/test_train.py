"""train.py end to end on the tiny model: it learns, saves in pyreft's format, and guards its command line."""

import json
import re
import sys

import pytest
import torch
from conftest import (
    COMMON,
    REPO,
    SAMPLE_DATA,
    assert_same_run,
    free_port,
    intervention_weights,
    logged_values,
    run_in_process,
    run_script,
    training_flags,
    truth_run,
)

from alpaca.model import build_reft_model, intervention_parameters, load_base_model
from alpaca.optim import optimizer_param_groups
from alpaca.output import load_reft_model, read_metrics, save_interventions

FAST = ["--num_sample_answers", "0", "--logging_steps", "1"]


def train(tiny_model, tiny_data, output_dir, *flags):
    """train.py in this process (what is checked is its output, not how it runs)."""
    status, _, stderr = run_in_process("train.py", training_flags(tiny_model, tiny_data, output_dir, *FAST, *flags))
    assert status == 0, stderr[-3000:]


@pytest.mark.parametrize("weight_decay", ["0.0", "0.1"])
def test_training_lowers_the_loss(tiny_model, tmp_path, weight_decay):
    """One fixed batch, so the curve is deterministic. With weight decay too: the rotation is kept out of
    it; if it were not, the rotation would be zeroed at the first step and the loss would stay flat."""
    data = tmp_path / "seven.json"  # the shipped sample's first 7 records, a batch that 15 steps fit visibly
    data.write_text(json.dumps(json.loads(SAMPLE_DATA.read_text())[:7]))
    train(tiny_model, data, tmp_path / "out", "--layers", "all", "--position", "f3+l3", "--rank", "4",
          "--learning_rate", "3e-2", "--per_device_train_batch_size", "7", "--max_steps", "15",
          "--weight_decay", weight_decay)
    losses = [record["loss"] for record in read_metrics(tmp_path / "out")]
    assert len(losses) == 15
    assert losses[-1] < 0.9 * losses[0] and losses[-1] < min(losses[:5]), losses
    assert (tmp_path / "out" / "loss.png").stat().st_size > 1000
    args = json.loads((tmp_path / "out" / "training_args.json").read_text())
    assert args["weight_decay"] == float(weight_decay) and args["total_steps"] == 15


@pytest.mark.fast
def test_the_run_comparison_catches_a_wrong_gradient_scale(tiny_model, tiny_data, tiny_eval_data, tmp_path,
                                                         monkeypatch):
    """A run whose objective is twice the right one (as when a `* world_size` or an accumulation factor is
    lost) against the right one, both in this process. With a negligible Adam epsilon and no clipping, AdamW
    divides the factor out exactly: the weights, losses and eval losses are bit-identical, and only the
    gradient norm tells the runs apart. The shared comparison must fail on it."""
    import alpaca.loss

    args = training_flags(tiny_model, tiny_data, None, *COMMON, "--max_steps", "4", "--per_device_train_batch_size",
                          "4", "--adam_epsilon", "1e-30", "--max_grad_norm", "0", "--eval_data_path", tiny_eval_data,
                          "--eval_strategy", "steps", "--eval_steps", "2")
    status, _, stderr = run_in_process("train.py", [*args, "--output_dir", tmp_path / "right"])
    assert status == 0, stderr[-3000:]
    truth_run(tmp_path / "right")  # the comparison's measure, trained before the objective is doubled here
    token_weighted_loss = alpaca.loss.token_weighted_loss
    monkeypatch.setattr(alpaca.loss, "token_weighted_loss", lambda *a, **k: 2 * token_weighted_loss(*a, **k))
    status, _, stderr = run_in_process("train.py", [*args, "--output_dir", tmp_path / "doubled"])
    assert status == 0, stderr[-3000:]

    right, doubled = intervention_weights(tmp_path / "right"), intervention_weights(tmp_path / "doubled")
    assert right.keys() == doubled.keys() and all(torch.equal(doubled[key], right[key]) for key in right)
    right_log, doubled_log = logged_values(tmp_path / "right"), logged_values(tmp_path / "doubled")
    assert doubled_log["loss"] == right_log["loss"] and doubled_log["eval_loss"] == right_log["eval_loss"]
    assert doubled_log["grad_norm"] == {step: 2 * norm for step, norm in right_log["grad_norm"].items()}
    with pytest.raises(AssertionError, match="grad_norm"):
        assert_same_run(tmp_path / "doubled", tmp_path / "right")
    assert_same_run(tmp_path / "right", tmp_path / "right", exact=True)


def test_noreft_trains_evaluates_and_saves(tiny_model, tiny_data, tiny_eval_data, tmp_path):
    """--intervention noreft end to end (in this process): the loss falls, NoReFT's bias is saved."""
    train(tiny_model, tiny_data, tmp_path, *COMMON, "--intervention", "noreft", "--max_steps", "6",
          "--per_device_train_batch_size", "7", "--eval_data_path", tiny_eval_data)
    losses = [record["loss"] for record in read_metrics(tmp_path) if "loss" in record]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert [record["step"] for record in read_metrics(tmp_path) if "eval_loss" in record] == [3, 6]
    assert any(name.endswith("/proj_layer.bias") for name in intervention_weights(tmp_path))


@pytest.mark.fast
def test_rotation_never_gets_weight_decay(tiny_model):
    model, _ = load_base_model(str(tiny_model), torch.float32, torch.device("cpu"))
    reft_model = build_reft_model(model, "all", (1, 1), False, low_rank_dimension=2)
    decay, no_decay = optimizer_param_groups(reft_model, 0.1)
    names = {id(p): n for n, p in intervention_parameters(reft_model)}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all("learned_source.weight" in names[id(p)] for p in decay["params"])
    assert sum("rotate_layer" in names[id(p)] for p in no_decay["params"]) == 8  # 4 layers x first and last positions


def test_pyreft_reload_reproduces_our_logits(tiny_model, tmp_path):
    """The output directory is pyreft's format: `ReftModel.load` rebuilds the same model."""
    import pyreft

    ids = torch.randint(0, 300, (2, 12))
    locations = [[[0, 1], [0, 1]]] * 2 + [[[10, 11], [10, 11]]] * 2
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = load_base_model(str(tiny_model), dtype, torch.device("cpu"))
        torch.manual_seed(0)
        reft_model = build_reft_model(model, "0;3", (2, 2), False, low_rank_dimension=3)
        for intervention in reft_model.interventions.values():
            torch.nn.init.normal_(intervention.learned_source.weight, std=0.2)
        with torch.no_grad():
            expected = reft_model({"input_ids": ids}, unit_locations={"sources->base": (None, locations)})[1].logits
        save_interventions(reft_model, tmp_path / str(dtype))
        assert all(t.device.type == "cpu" for f in (tmp_path / str(dtype)).glob("intkey_*.bin")
                   for t in torch.load(f, weights_only=True).values())
        loaders = [load_reft_model] + ([pyreft.ReftModel.load] if dtype == torch.bfloat16 else [])
        for load in loaders:
            fresh, _ = load_base_model(str(tiny_model), dtype, torch.device("cpu"))
            reloaded = load(str(tmp_path / str(dtype)), fresh)
            with torch.no_grad():
                actual = reloaded({"input_ids": ids}, unit_locations={"sources->base": (None, locations)})[1].logits
            if load is load_reft_model:  # float32 interventions on either base, as trained
                assert torch.equal(actual, expected), dtype
            else:  # pyreft's: the saved float32 learned source rounded to bf16 and computed there (~1.5 % measured;
                # the interventions move these logits by ~80 % of their largest)
                assert (actual - expected).abs().max() <= 0.05 * expected.abs().max()


def documented_pyreft_loader() -> str:
    """The python block of docs/training.md that loads an output with pyreft's own loader."""
    page = (REPO / "docs" / "training.md").read_text()
    return re.search(r"with pyreft's own loader.*?```python\n(.*?)```", page, re.S)[1]


def test_the_documented_pyreft_loader_gives_load_reft_models_logits(tiny_model, tmp_path):
    """docs/training.md's recipe run verbatim on a float32 base: pyreft.ReftModel.load, then each intervention cast
    to float32 and its saved state loaded again, gives load_reft_model's logits bit for bit. Cast without loading
    again, it keeps the bf16 rounding of pyreft's load, which these logits show."""
    import transformers

    ids = torch.randint(0, 300, (2, 12))
    locations = [[[0, 1], [0, 1]]] * 2 + [[[10, 11], [10, 11]]] * 2
    model, _ = load_base_model(str(tiny_model), torch.float32, torch.device("cpu"))
    torch.manual_seed(0)
    reft_model = build_reft_model(model, "0;3", (2, 2), False, low_rank_dimension=3)
    for intervention in reft_model.interventions.values():
        torch.nn.init.normal_(intervention.learned_source.weight, std=0.2)
    save_interventions(reft_model, tmp_path)

    def logits(loaded) -> torch.Tensor:
        with torch.no_grad():
            return loaded({"input_ids": ids}, unit_locations={"sources->base": (None, locations)})[1].logits

    # the base as the recipe loads it
    base = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32, device_map="cpu")
    expected = logits(load_reft_model(tmp_path, base))
    recipe = documented_pyreft_loader()
    cast_only = recipe.replace(".float().load_state_dict(torch.load(f\"{OUT}/intkey_{key}.bin\", weights_only=True))",
                               ".float()")
    assert cast_only != recipe
    for code, exact in ((recipe, True), (cast_only, False)):
        namespace = {"MODEL": str(tiny_model), "OUT": str(tmp_path), "DEVICE": "cpu"}
        exec(code, namespace)
        assert all(parameter.dtype == torch.float32 for parameter in namespace["reft_model"].interventions.parameters())
        assert torch.equal(logits(namespace["reft_model"]), expected) == exact


def test_pyreft_example_command_line_runs(pyreft_example_run):
    """The command line of pyreft's examples/alpaca (the run is shared with the 4-process test)."""
    output_dir, stdout = pyreft_example_run
    assert len(read_metrics(output_dir)) == 2  # 21 examples, global batch 32: one step per epoch
    assert "BASE MODEL" in stdout and "REFT MODEL" in stdout
    assert sorted(p.name for p in output_dir.glob("intkey_*.bin")) and (output_dir / "config.json").exists()


@pytest.mark.fast
def test_help_and_usage_errors_of_both_scripts_need_no_heavy_imports(tmp_path):
    """--help, a parse error and a bad --deepspeed config (unreadable, invalid JSON, a refused value) answer
    before torch, transformers, datasets, pyvene or pyreft are imported."""
    bad_json, refused = tmp_path / "bad.json", tmp_path / "refused.json"
    bad_json.write_text("{")
    refused.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {"params": {"lr": 1e-3}}}))
    cases = [["--help"], ["--layers", "8;x"], ["--learning_rate", "x"], ["--deepspeed", str(tmp_path / "none.json")],
             ["--deepspeed", str(bad_json)], ["--deepspeed", str(refused)]]
    code = f"""
import contextlib, io, json, runpy, sys
answers = []
for script in ("train.py", "train_multigpu.py"):
    for argv in {cases!r}:
        out, err = io.StringIO(), io.StringIO()
        sys.argv = [script, *argv]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as exit:
                answers.append([exit.code, out.getvalue()[:40], err.getvalue()])
heavy = sorted(m for m in ("torch", "transformers", "datasets", "pyvene", "pyreft") if m in sys.modules)
print(json.dumps([heavy, answers]))
"""
    result = run_script(["-c", code])
    heavy, answers = json.loads(result.stdout.splitlines()[-1])
    assert heavy == [], result.stderr[-3000:]
    assert [code for code, *_ in answers] == [0, 2, 2, 2, 2, 2] * 2
    assert all(out.startswith("usage:") for _, out, _ in answers[::6])
    multigpu_errors = [err for *_, err in answers[9:]]
    assert "cannot read it" in multigpu_errors[0] and "invalid JSON" in multigpu_errors[1]
    assert "the optimizer comes from" in multigpu_errors[2]
    assert all(err.count("\n") == 1 for *_, err in answers[1:6] + answers[7:]), answers  # one line each


@pytest.mark.fast
@pytest.mark.parametrize("flags,message", [
    (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag"),
    (["--position", "f1+"], "--position 'f1+' is malformed"),
    (["--layers", "8;x"], "--layers '8;x' is malformed"),
    (["--rank", "0"], "--rank must be a positive integer"),
    (["--evaluation_strategy", "sometimes"], "invalid choice: 'sometimes'"),
    (["--pad_to_multiple_of", "0"], "--pad_to_multiple_of must be a positive integer"),
    (["--dataloader_num_workers", "-1"], "--dataloader_num_workers must be 0 or more"),
    (["--preprocessing_num_workers", "0"], "--preprocessing_num_workers must be 1 or more"),
])
def test_usage_errors_are_one_line(flags, message):
    result = run_script(["train.py", *flags])
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.fast
def test_device_dependent_defaults():
    """Bounded shapes and worker processes on CUDA, neither on CPU (README, Performance); given values stay."""
    from alpaca.args import parse_args, resolve_device_defaults

    for device_type, expected in [("cuda", (64, 2)), ("cpu", (1, 0))]:
        args = parse_args("train.py", [])
        resolve_device_defaults(args, device_type)
        assert (args.pad_to_multiple_of, args.dataloader_num_workers) == expected
    args = parse_args("train.py", ["--pad_to_multiple_of", "8", "--dataloader_num_workers", "0"])
    resolve_device_defaults(args, "cuda")
    assert (args.pad_to_multiple_of, args.dataloader_num_workers) == (8, 0)


@pytest.mark.fast
def test_train_py_refuses_torchrun():
    result = run_script(["--nproc_per_node", "2", "--master_port", str(free_port()), "train.py", "--help"],
                        launcher=[sys.executable, "-m", "torch.distributed.run"], timeout=120)
    assert result.returncode != 0
    assert "use: torchrun --nproc_per_node 2 train_multigpu.py" in result.stderr.lower()
