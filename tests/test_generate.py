"""examples/generate.py: base vs ReFT answers of a trained run, and two runs compared."""

import json
import shutil

import pytest
import torch
from conftest import LAYERS, REPO, disk_map, run_in_process, run_script, training_flags

from alpaca.data import render_prompt
from alpaca.generation import SAMPLE_INSTRUCTIONS, answer
from alpaca.model import build_reft_model, load_base_model
from alpaca.output import load_reft_model, save_interventions

GENERATE = str(REPO / "examples" / "generate.py")
INSTRUCTIONS = ["Give two tips for staying focused.", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def untrained(runs, tiny_tied_model, tmp_path_factory):
    """The output the `runs` recipe would leave without training: its initial interventions (the same seed)."""
    root, _ = runs
    directory = tmp_path_factory.mktemp("untrained")
    shutil.copy(root / "single" / "training_args.json", directory)
    model, _ = load_base_model(str(tiny_tied_model), torch.float32, torch.device("cpu"))
    torch.manual_seed(42)
    save_interventions(build_reft_model(model, LAYERS, (2, 2), False, low_rank_dimension=4), directory)
    return directory


def answers(run_dir, model_dir) -> list[tuple[str, str]]:
    model, tokenizer = load_base_model(str(model_dir), torch.float32, torch.device("cpu"))
    reft_model = load_reft_model(run_dir, model)
    return [answer(reft_model, tokenizer, instruction, (2, 2), False, 2, max_new_tokens=8)
            for instruction in INSTRUCTIONS]


def test_the_reft_answer_is_the_trained_model_s(runs, untrained, tiny_tied_model):
    """Answers of the trained interventions differ from those of the initial ones (whose answers already differ
    from the base's), and 1 and 2 processes trained interventions that answer alike."""
    root, _ = runs
    trained, initial = answers(root / "single", tiny_tied_model), answers(untrained, tiny_tied_model)
    assert [base for base, _ in trained] == [base for base, _ in initial]
    assert all(reft and reft != initial_reft for (_, reft), (_, initial_reft) in zip(trained, initial))
    assert answers(root / "ddp", tiny_tied_model) == trained


@pytest.mark.fast
def test_generate_prints_base_and_reft_side_by_side(runs, tiny_tied_model):
    root, _ = runs
    status, stdout, stderr = run_in_process(GENERATE, ["--reft_dir", root / "single", "--instruction",
                                                       INSTRUCTIONS[0], "--max_new_tokens", "8"])
    assert status == 0, stderr[-3000:]
    assert f"Instruction: {INSTRUCTIONS[0]}" in stdout
    assert compared(stdout, "REFT MODEL") == answers(root / "single", tiny_tied_model)[0]


def compared(stdout: str, second) -> tuple[str, str]:
    """The two answers that generate.py printed side by side for its one instruction."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.endswith(" | " + str(second)))
    column = lines[header].index(" | ")  # the answers' columns are cut where the headers' are
    return lines[header + 1][:column].strip(), lines[header + 1][column + 3 :].strip()


def test_generate_compares_two_runs(runs, untrained, tiny_tied_model):
    """The trained run against its untrained interventions: each column holds its run's answer, and they differ."""
    root, _ = runs
    status, stdout, stderr = run_in_process(GENERATE, ["--reft_dir", root / "single", "--compare", untrained,
                                                       "--instruction", INSTRUCTIONS[1], "--max_new_tokens", "8"])
    assert status == 0, stderr[-3000:]
    left, right = compared(stdout, untrained)
    assert left == answers(root / "single", tiny_tied_model)[1][1]
    assert right == answers(untrained, tiny_tied_model)[1][1]
    assert left != right


def test_generate_with_layers_on_disk_answers_the_one_device_tokens(runs, tiny_tied_model, tmp_path, monkeypatch):
    """--device_map with decoder layers 0 and 2 on disk (2 intervened, 0 not): the base's and the ReFT model's
    answers are the plain run's token for token (decode is made to print the token ids), and the layers were on
    disk (the placement line), so the test cannot pass by ignoring the map."""
    from transformers import PreTrainedTokenizerFast

    monkeypatch.setattr(PreTrainedTokenizerFast, "decode", lambda self, ids, **kwargs: str(ids.tolist()))
    root, _ = runs
    ask = ["--reft_dir", root / "single", *(item for i in INSTRUCTIONS for item in ("--instruction", i)),
           "--max_new_tokens", "8"]
    status, plain, stderr = run_in_process(GENERATE, ask)
    assert status == 0, stderr[-3000:]
    status, mapped, stderr = run_in_process(GENERATE, [*ask, "--device_map", disk_map(), "--offload_folder",
                                                       tmp_path / "offload"])
    assert status == 0, stderr[-3000:]
    placement, *table = mapped.splitlines()
    assert placement == "Base model on --device_map (cpu: 6 modules, disk: 2 modules)"
    assert table == plain.splitlines() and plain.count("Instruction: ") == 2


@pytest.mark.parametrize(("placement", "message"), [
    (["--device_map", '{"model.embed": "cpu", "": "cpu"}'], "--device_map names 'model.embed', which is not a module"),
    (["--device_map", '{"": 0}'], "--device_map: GPU 0 is not there: this process has no GPU"),
    (["--device_map", "{model: cpu}"], "--device_map '{model: cpu}' is neither one of auto, balanced"),
    (["--device_map", '{"": "disk"}'], "--device_map puts modules on 'disk': add --offload_folder DIR"),
])
def test_generate_refuses_a_bad_device_map_in_one_line(runs, placement, message):
    """The checks of training (tests/test_bad_input.py has them all): one line, exit 2, no traceback."""
    root, _ = runs
    status, _, stderr = run_in_process(GENERATE, ["--reft_dir", root / "single", *placement])
    assert status == 2, stderr[-3000:]
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("generate.py: error: ") and message in errors[0], stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == errors[0] and "Traceback" not in stderr


@pytest.mark.fast
def test_generate_needs_a_training_output(tmp_path):
    result = run_script([GENERATE, "--reft_dir", str(tmp_path)])
    assert result.returncode == 2
    assert "has no training_args.json" in result.stderr.strip().splitlines()[-1]


def test_generate_refuses_a_run_whose_arguments_lack_a_setting(runs, tmp_path):
    """training_args.json without a setting generation needs (another program's, or hand-edited): one line, exit 2."""
    root, _ = runs
    settings = json.loads((root / "single" / "training_args.json").read_text())
    del settings["prompt_template"]
    (tmp_path / "training_args.json").write_text(json.dumps(settings))
    status, _, stderr = run_in_process(GENERATE, ["--reft_dir", tmp_path])
    assert status == 2, stderr[-3000:]
    assert stderr.strip().splitlines() == [f"generate.py: error: {str(tmp_path / 'training_args.json')!r} records no "
                                           "prompt_template: it was not written by this train.py; train the run again"]


def test_a_chat_trained_run_answers_with_the_chat_template(tiny_chat_model, tiny_data, tmp_path, monkeypatch):
    """train.py --prompt_template chat records the template; its sample answers and examples/generate.py on its
    output build their prompts with the tokenizer's chat template."""
    import alpaca.generation

    prompts = []

    def recording_render_prompt(tokenizer, instruction, input, prompt_template):
        prompts.append(render_prompt(tokenizer, instruction, input, prompt_template))
        return prompts[-1]

    monkeypatch.setattr(alpaca.generation, "render_prompt", recording_render_prompt)
    output_dir = tmp_path / "chat"
    status, stdout, stderr = run_in_process("train.py", training_flags(
        tiny_chat_model, tiny_data, output_dir, "--prompt_template", "chat", "--max_steps", "2",
        "--num_sample_answers", "1", "--max_new_tokens", "4"))
    assert status == 0, stderr[-3000:]
    assert json.loads((output_dir / "training_args.json").read_text())["prompt_template"] == "chat"
    chat_prompt = f"<s><|im_start|>user\n{SAMPLE_INSTRUCTIONS[0]}</s>\n<|im_start|>assistant\n"
    assert prompts == [chat_prompt] and f"Instruction: {SAMPLE_INSTRUCTIONS[0]}" in stdout

    prompts.clear()
    status, stdout, stderr = run_in_process(GENERATE, ["--reft_dir", output_dir, "--instruction", INSTRUCTIONS[0],
                                                       "--max_new_tokens", "4"])
    assert status == 0, stderr[-3000:]
    assert prompts == [f"<s><|im_start|>user\n{INSTRUCTIONS[0]}</s>\n<|im_start|>assistant\n"]
    assert f"Instruction: {INSTRUCTIONS[0]}" in stdout
