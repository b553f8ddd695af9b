"""examples/generate.py: base vs ReFT answers of a trained run, and two runs compared."""

import torch
from conftest import REPO, run_script

from alpaca.generation import answer
from alpaca.model import load_base_model
from alpaca.output import load_reft_model

GENERATE = str(REPO / "examples" / "generate.py")


def test_the_reft_answer_uses_the_trained_interventions(runs, tiny_model):
    root, _ = runs
    model, tokenizer = load_base_model(str(tiny_model), torch.float32, torch.device("cpu"))
    reft_model = load_reft_model(root / "single", model)
    base, reft = answer(reft_model, tokenizer, "Name three primary colors.", (2, 2), False, 2, max_new_tokens=8)
    assert base and reft and base != reft


def test_generate_prints_base_and_reft_side_by_side(runs):
    root, _ = runs
    result = run_script([GENERATE, "--reft_dir", str(root / "single"), "--instruction", "Name three primary colors.",
                         "--max_new_tokens", "8"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Instruction: Name three primary colors." in result.stdout
    assert "BASE MODEL" in result.stdout and "REFT MODEL" in result.stdout


def test_generate_compares_two_runs(runs):
    """The single-process and the 2-rank run trained the same model: the same answers."""
    root, _ = runs
    result = run_script([GENERATE, "--reft_dir", str(root / "single"), "--compare", str(root / "ddp"),
                         "--instruction", "Give two tips for staying focused.", "--max_new_tokens", "8"])
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.endswith(" | " + str(root / "ddp")))
    column = lines[header].index(" | ")  # the answers' columns are cut where the headers' are
    left, right = lines[header + 1][:column], lines[header + 1][column + 3 :]
    assert left.strip() == right.strip() and left.strip()


def test_generate_needs_a_training_output(tmp_path):
    result = run_script([GENERATE, "--reft_dir", str(tmp_path)])
    assert result.returncode == 2
    assert "has no training_args.json" in result.stderr.strip().splitlines()[-1]
