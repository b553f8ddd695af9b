"""What a researcher changes in a copy: other field names, another prompt, a loss term. Edits never meet stale
caches."""

import importlib.util
import json
import math
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from conftest import (
    FLOAT64_RTOL,
    REPO,
    SAMPLE_DATA,
    assert_same_run,
    deepspeed_config_file,
    free_port,
    intervention_weights,
    logged_values,
    run_script,
    training_flags,
)

from alpaca.args import parse_args
from alpaca.data import load_records
from alpaca.errors import UsageError
from alpaca.output import read_metrics


@pytest.fixture
def question_answer_data(tmp_path):
    records = json.loads(SAMPLE_DATA.read_text())[:4]
    path = tmp_path / "qa.json"
    path.write_text(json.dumps([{"question": r["instruction"], "answer": r["output"]} for r in records]))
    return path, records


def test_other_field_names_are_refused_with_the_flag_that_maps_them(question_answer_data):
    path, _ = question_answer_data
    with pytest.raises(UsageError, match=r"holds records with fields 'question', 'answer', none of the formats "
                                         r"accepted: Alpaca .* --field_map question=instruction,answer=output"):
        load_records(str(path))


def test_field_map_renames_them(question_answer_data):
    path, records = question_answer_data
    args = parse_args("train.py", ["--data_path", str(path), "--field_map", "question=instruction,answer=output"])
    dataset = load_records(str(path), field_map=args.field_map)
    assert dataset["instruction"] == [r["instruction"] for r in records]
    assert dataset["output"] == [r["output"] for r in records] and dataset["input"] == [""] * 4


def test_a_field_of_the_wrong_type_is_named_as_such(tmp_path):
    """A conversation mapped onto 'instruction' is there, as a list: the message says so."""
    path = tmp_path / "chat.json"
    path.write_text(json.dumps([{"messages": [{"role": "user", "content": "Hi"}], "output": "Hello"}]))
    with pytest.raises(UsageError, match=r"record 0 of .* has 'instruction', but as a list, not a string; map a "
                                         r"string field to 'instruction' with --field_map"):
        load_records(str(path), field_map={"messages": "instruction"})


def test_a_malformed_field_map_is_one_line(question_answer_data, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args("train.py", ["--field_map", "question=prompt"])
    assert exit_info.value.code == 2
    assert "TARGET one of instruction, input, output" in capsys.readouterr().err


def test_editing_the_prompt_in_a_copy_never_reuses_the_cached_tokenization(tiny_model, tmp_path, monkeypatch):
    """The tokenization cache is keyed by the code that builds prompts and labels, not only the templates: a copy
    of alpaca/data.py, edited to another prompt and loaded anew (as a module of its own, in this process), finds
    the cache the unedited copy filled and tokenizes afresh."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    data = tmp_path / "data.py"
    shutil.copy(REPO / "alpaca" / "data.py", data)

    def prompt_length(version: str) -> int:
        spec = importlib.util.spec_from_file_location(f"data_{version}", data)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)  # as an import does (its dataclasses look it up)
        spec.loader.exec_module(module)
        dataset = module.prepare_dataset(module.load_records(str(SAMPLE_DATA)), tokenizer, 512,
                                         cache_dir=str(tmp_path / "cache"))
        return dataset[0]["prompt_length"]

    original = prompt_length("original")
    source = data.read_text()
    edited = source.replace("def format_prompt(instruction: str, input: str | None = \"\") -> str:\n",
                            "def format_prompt(instruction: str, input: str | None = \"\") -> str:\n"
                            "    return f\"Q: {instruction}\\nA: \"\n")
    assert edited != source
    data.write_text(edited)
    assert prompt_length("edited") < original  # tokenized afresh with the short template, not read from the cache


def guide_sections() -> list[tuple[str, str, list[str]]]:
    """(title, diff or None where flags do it, [command, ...]) of each adaptation in docs/adapting.md."""
    text = (REPO / "docs" / "adapting.md").read_text()
    sections = []
    for section in re.split(r"^## ", text, flags=re.M)[1:]:
        diff = re.search(r"```diff\n(.*?)```", section, re.S)
        commands = re.search(r"```bash\n(.*?)```", section, re.S)
        sections.append((section.splitlines()[0], diff and diff[1], commands[1].strip().splitlines()))
    return sections


def guide_copy(directory, diff: str | None):
    """A fresh copy of the repository with a guide section's diff applied."""
    ignored = shutil.ignore_patterns(".git", ".venv", "__pycache__", "output", "out_*", "wandb")
    shutil.copytree(REPO, directory, ignore=ignored)
    if diff is not None:
        applied = subprocess.run(["git", "apply", "-C1", "-"], input=diff, cwd=directory, capture_output=True,
                                 text=True)
        assert applied.returncode == 0, applied.stderr
    return directory


def run_guide_command(command: str, copy, tiny_model, tiny_chat_model, data, *flags: str):
    """One of the guide's commands, run in `copy` as a user would: two steps on the tiny model (with its chat
    template for --prompt_template chat), on the question-answer data unless the command names data shipped in
    examples/, then `flags`. Returns the training's output directory (None for generation)."""
    words = shlex.split(command)
    assert words[0] in ("python", "torchrun"), command
    model = tiny_chat_model if "--prompt_template chat" in command else tiny_model
    shipped_data = "--data_path" in words and (copy / words[words.index("--data_path") + 1]).exists()
    data_flags = [] if shipped_data else ["--field_map", "question=instruction,answer=output", "--data_path", str(data)]
    extra = ["--max_new_tokens", "4", "--instruction", "Name three primary colors."] if "generate.py" in command \
        else training_flags(model, None, None, "--max_steps", "2", "--logging_steps", "1", "--num_sample_answers", "0",
                            *data_flags, *flags)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--master_port", str(free_port())] \
        if words[0] == "torchrun" else None
    # One thread, as torchrun gives each of its workers: the kernels then sum in the same order, and what the
    # python and torchrun runs compare is what 1 and 2 processes change (a thread count alone moves weights
    # that Adam scales from near-zero gradients by up to 4e-6).
    result = run_script([*words[1:], *extra], cwd=copy, launcher=launcher, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
    return copy / words[words.index("--output_dir") + 1] if "--output_dir" in words and "generate.py" not in command \
        else None


@pytest.mark.parametrize("title,diff,commands", guide_sections(), ids=[s[0] for s in guide_sections()])
def test_each_adaptation_in_the_guide_applies_and_trains(title, diff, commands, tiny_model, tiny_chat_model,
                                                         question_answer_data, tmp_path):
    """The documented diff applies to a fresh copy of the repository, and its commands run there
    (`run_guide_command`); each torchrun command trains the model of the python command before it. (h)'s runs
    also log the weight norm of what they save."""
    copy = guide_copy(tmp_path / "copy", diff)
    data, _ = question_answer_data
    outputs, commands_run = {}, {}
    for command in commands:
        output_dir = run_guide_command(command, copy, tiny_model, tiny_chat_model, data)
        if output_dir is not None:
            outputs[shlex.split(command)[0]], commands_run[shlex.split(command)[0]] = output_dir, command
            if title.startswith("(h)"):
                assert_logs_the_saved_weight_norm(output_dir)
        if command.startswith("torchrun"):  # the adaptation trains one model on 1 and N processes
            truth = copy / "truth"  # the python command in float64, in the adapted copy: see conftest.NOISE_MARGIN
            run_guide_command(commands_run["python"], copy, tiny_model, tiny_chat_model, data, "--dtype", "float64",
                              "--output_dir", str(truth))
            assert_same_run(outputs["torchrun"], outputs["python"], truth_dir=truth)
            shutil.rmtree(truth)


def test_the_l2_penalty_adds_its_written_strength_once_per_step(tiny_model, tiny_chat_model, question_answer_data,
                                                                 tmp_path):
    """(g): the first step's logged loss is the unchanged copy's plus λ·Σ‖θ₀‖² of the initial weights, λ as the
    diff writes it, on 1 process (2 micro-batches) and on 2: not divided by the step's label tokens nor by its
    micro-batches. At a learning rate of 1e-30 the saved interventions are the initial ones. In float64, so that
    the sums agree to float64's rounding (conftest.FLOAT64_RTOL)."""
    _, diff, commands = next(section for section in guide_sections() if section[0].startswith("(g)"))
    strength = float(re.search(r"^\+L2_PENALTY = (\S+)", diff, re.M)[1])
    copies = {"penalized": guide_copy(tmp_path / "penalized", diff),
              "unchanged": guide_copy(tmp_path / "unchanged", None)}
    data, _ = question_answer_data
    for command in commands[:2]:  # python and torchrun
        flags = ["--max_steps", "1", "--learning_rate", "1e-30", "--dtype", "float64"]
        runs = {name: run_guide_command(command, copy, tiny_model, tiny_chat_model, data, *flags)
                for name, copy in copies.items()}
        initial = intervention_weights(runs["penalized"])
        squared_norm = sum(tensor.double().pow(2).sum().item() for key, tensor in initial.items()
                           if not key.endswith("/rotate_layer"))
        added = logged_values(runs["penalized"])["loss"][1] - logged_values(runs["unchanged"])["loss"][1]
        assert squared_norm > 0 and added == pytest.approx(strength * squared_norm, rel=FLOAT64_RTOL), command


def assert_logs_the_saved_weight_norm(output_dir) -> None:
    """(h): every training record has a weight norm, and the last one is the norm of the interventions the run
    saved (LoReFT's rotation left out), to float64's rounding: both sum the float32 weights' squares in float64,
    in another order (conftest.FLOAT64_RTOL). A partition counted twice, or read as empty, is far off."""
    records = [record for record in read_metrics(output_dir) if "loss" in record]
    assert records and all(record["weight_norm"] > 0 for record in records)
    saved = intervention_weights(output_dir)
    norm = math.sqrt(sum(tensor.double().pow(2).sum().item() for key, tensor in saved.items()
                         if not key.endswith("/rotate_layer")))
    assert records[-1]["weight_norm"] == pytest.approx(norm, rel=FLOAT64_RTOL)


def test_the_weight_norm_counts_each_zero3_partition_once(tiny_model, tiny_chat_model, question_answer_data,
                                                          tmp_path):
    """(h)'s torchrun command under ZeRO-3 with no persistence threshold: between forwards each rank holds a
    partition of each intervention weight and the parameter itself no elements. The logged norm is still the
    saved interventions'."""
    _, diff, commands = next(section for section in guide_sections() if section[0].startswith("(h)"))
    copy = guide_copy(tmp_path / "copy", diff)
    data, _ = question_answer_data
    torchrun_command = next(command for command in commands if command.startswith("torchrun"))
    output_dir = run_guide_command(torchrun_command, copy, tiny_model, tiny_chat_model, data, "--deepspeed",
                                   str(deepspeed_config_file(tmp_path, 3)))
    assert json.loads((output_dir / "training_args.json").read_text())["deepspeed"].endswith("zero3.json")
    assert_logs_the_saved_weight_norm(output_dir)
