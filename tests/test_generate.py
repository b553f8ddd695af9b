"""examples/generate.py: base vs ReFT answers of a trained run, two runs compared, and a file of answers to score."""

import json
import runpy
import shutil
import sys
from pathlib import Path

import pytest
import torch
from collective_ledger import check as check_ledger
from conftest import (
    FAULTS,
    LAYERS,
    REPO,
    disk_map,
    mixed_records,
    one_thread,
    run_in_process,
    run_script,
    torchrun,
    training_flags,
    with_faked_gpus,
    workers_output,
)
from datasets import Dataset

from alpaca.constants import HELD_OUT_FILE
from alpaca.data import canonical_records, conversation_tokens, load_records, load_splits, render_prompt
from alpaca.errors import UsageError
from alpaca.generation import SAMPLE_INSTRUCTIONS, answer, prompt_ids
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
    (["--resume"], "--resume applies to a file of answers; add --output_file FILE"),
    (["--output_file", "a.json"], "--output_file needs --instructions_file (or --held_out): the records to answer"),
    (["--output_file", "a.json", "--instructions_file", "eval.json", "--instruction", "Hi."],
     "--output_file answers the records of one file; --instruction would be left out: put its records in the"),
    (["--output_file", "a.json", "--instructions_file", "eval.json", "--conversations_file", "chats.jsonl"],
     "--output_file answers the records of one file; --conversations_file would be left out: put its records"),
    (["--held_out"], "was trained without --eval_split_ratio, so it held no records out"),
    (["--held_out", "--instructions_file", "eval.json"], "--held_out and --instructions_file both name the records"),
    (["--output_file", "a.json", "--compare", "b"], "--compare prints two runs side by side; write each run's"),
    (["--temperature", "0.7"], "--temperature and --top_p apply to sampling; add --do_sample"),
    (["--instructions_file", str(REPO / "README.md") + ".json"], "README.md.json' does not exist"),
])
def test_generate_refuses_bad_flags_in_one_line(runs, placement, message):
    """The device map's checks of training (tests/test_bad_input.py has them all) and those of the answers file:
    one line, exit 2, no traceback."""
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


# -- a file of answers to score (--output_file) ------------------------------------------------------------------
KILL = str(REPO / "tests" / "kill_at_batch.py")


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory):
    """11 records to answer, in batches of 3 (4 batches, the last partial): held-out Alpaca records with and
    without input, one with AlpacaEval's `dataset`, a bare instruction, and one longer than the run's
    --model_max_length (512), which is cut. Each instruction once, as AlpacaEval joins answers on it."""
    records = list({r["instruction"]: r for r in mixed_records()[21:]}.values())[:9]  # each instruction once
    records[2] = {**records[2], "dataset": "helpful_base"}
    records += ["Name a color.", {"instruction": "Repeat after me: " + "rain falls on the hills. " * 150}]
    path = tmp_path_factory.mktemp("eval") / "eval.json"
    path.write_text(json.dumps(records))
    return path, records


def answer_file(run_dir, eval_path, output, *extra) -> str:
    status, stdout, stderr = run_in_process(GENERATE, ["--reft_dir", run_dir, "--instructions_file", eval_path,
                                                       "--output_file", output, "--per_device_batch_size", "3",
                                                       "--max_new_tokens", "6", "--dtype", "float32", *extra])
    assert status == 0, stderr[-3000:]
    return stdout


def test_generate_writes_answers_to_score(runs, eval_file, tmp_path, monkeypatch):
    """The file AlpacaEval reads, in input order (alpaca_eval's own loader and head-to-head join take it, with
    the --base file as the reference); the long record cut and reported; the summary and settings beside it;
    on a base with layers on disk (--device_map) the same answers; on a 4-bit base, every record answered."""
    root, _ = runs
    path, records = eval_file
    stdout = answer_file(root / "single", path, tmp_path / "answers.json")
    rows = json.loads((tmp_path / "answers.json").read_text())
    assert [row["instruction"] for row in rows] == [r if isinstance(r, str) else r["instruction"] for r in records]
    for row, record in zip(rows, records):
        record = record if isinstance(record, dict) else {}
        fields = {"instruction", "output", "generator", "dataset"} | ({"input"} if record.get("input") else set())
        fields |= {"reference"} if "output" in record else set()
        assert row.keys() == fields and row["generator"] == "single" and isinstance(row["output"], str)
        assert row.get("reference") == record.get("output")
        assert row["dataset"] == record.get("dataset", "eval") and row.get("input") == (record.get("input") or None)
    cut = f"Cut 1 prompt(s) to --model_max_length 512 tokens, as training cuts an example: record(s) {len(records) - 1}"
    assert cut in stdout and "IS_ALPACA_EVAL_2=False alpaca_eval --model_outputs" in stdout
    saved = json.loads((tmp_path / "answers.summary.json").read_text())
    assert (saved["prompts_cut"], saved["per_device_batch_size"], saved["base_dtype"]) == ([len(records) - 1], 3,
                                                                                            "float32")
    assert saved["summary"]["answers"] == len(records) and saved["summary"]["mean_tokens"] > 0
    assert not (tmp_path / "answers.json.partial").exists()

    answer_file(root / "single", path, tmp_path / "base.json", "--base")
    base_rows = json.loads((tmp_path / "base.json").read_text())
    assert {row["generator"] for row in base_rows} == {"single-base"}
    assert [row["output"] for row in base_rows] != [row["output"] for row in rows]
    annotated = alpaca_eval_pairs(tmp_path / "base.json", tmp_path / "answers.json", monkeypatch)
    assert sorted(annotated["output_2"]) == sorted(row["output"] for row in rows) and len(annotated) == len(rows)

    stdout = answer_file(root / "single", path, tmp_path / "mapped.json", "--device_map", disk_map(),
                         "--offload_folder", tmp_path / "offload")
    assert "Base model on --device_map (cpu: 6 modules, disk: 2 modules)" in stdout
    assert (tmp_path / "mapped.json").read_text() == (tmp_path / "answers.json").read_text()
    answer_file(root / "single", path, tmp_path / "4bit.json", "--load_in_4bit")
    assert len(json.loads((tmp_path / "4bit.json").read_text())) == len(records)
    assert json.loads((tmp_path / "4bit.summary.json").read_text())["load_in_4bit"] is True


def alpaca_eval_pairs(reference, model_outputs, monkeypatch):
    """What AlpacaEval 1.0 (`IS_ALPACA_EVAL_2=False alpaca_eval --model_outputs ... --reference_outputs ...`) gives
    its GPT-4 judge: both files read by its own loader, joined by its head-to-head annotator (the judge's call
    replaced by the identity)."""
    import importlib.util
    import types

    if importlib.util.find_spec("alpaca_eval") is None:
        pytest.skip("alpaca_eval is not installed (requirements-dev.txt)")
    try:
        import pkg_resources  # noqa: F401
    except ImportError:  # alpaca_eval 0.6.6 imports it (for version checks not used here); setuptools >= 81 has none
        monkeypatch.setitem(sys.modules, "pkg_resources", types.ModuleType("pkg_resources"))
    monkeypatch.setenv("IS_ALPACA_EVAL_2", "False")
    from alpaca_eval import utils
    from alpaca_eval.annotators import PairwiseAnnotator

    monkeypatch.setattr(PairwiseAnnotator, "__call__", lambda self, pairs, **kwargs: pairs)
    outputs = utils.load_or_convert_to_dataframe(model_outputs)
    assert utils.get_generator_name(None, outputs) == json.loads(Path(model_outputs).read_text())[0]["generator"]
    annotator = PairwiseAnnotator(annotators_config="alpaca_eval_gpt4")
    return annotator.annotate_head2head(outputs_1=utils.load_or_convert_to_dataframe(reference), outputs_2=outputs)


def test_more_processes_than_gpus(runs, eval_file, tmp_path):
    """2 processes on a node with 1 GPU (faked): one line says what to do, as training says it."""
    result = torchrun(2, [*with_faked_gpus(1), GENERATE, "--reft_dir", str(runs[0] / "single"), "--instructions_file",
                          str(eval_file[0]), "--output_file", str(tmp_path / "answers.json")], extra=["--no-python"])
    assert result.returncode != 0
    message = "generate.py: error: 2 processes on this node but 1 GPU(s) visible; launch with --nproc_per_node 1"
    assert workers_output(result.stderr).count(message) == 1, result.stderr[-3000:]
    assert not (tmp_path / "answers.json").exists()


def test_two_processes_killed_and_resumed_write_one_process_s_file(runs, eval_file, tmp_path):
    """Sampled answers (--do_sample, seeded): 2 processes, one killed after its first batch, then resumed, write
    the file one process writes, byte for byte. The resumed run keeps the finished batches' answers (one is
    marked to show it), skips a line cut by the kill, answers each record once, and refuses other settings."""
    root, _ = runs
    path, records = eval_file
    sampling = ["--do_sample", "--temperature", "0.8", "--seed", "7"]
    with one_thread():  # as torchrun runs each process
        answer_file(root / "single", path, tmp_path / "one.json", *sampling)
    flags = ["--reft_dir", str(root / "single"), "--instructions_file", str(path), "--output_file",
             str(tmp_path / "two.json"), "--per_device_batch_size", "3", "--max_new_tokens", "6", "--dtype", "float32",
             *sampling]
    partial = tmp_path / "two.json.partial"
    killed = torchrun(2, [KILL, *flags], env={"KILL_RANK": "1", "KILL_BATCH": "2",
                                              "KILL_AFTER": f"{partial / 'rank-0.jsonl'}:6"})
    assert killed.returncode != 0 and not (tmp_path / "two.json").exists()
    first = json.loads((partial / "rank-0.jsonl").read_text().splitlines()[0])
    assert len((partial / "rank-0.jsonl").read_text().splitlines()) == 6  # rank 0: its 2 batches
    assert len((partial / "rank-1.jsonl").read_text().splitlines()) == 3  # rank 1: 1 of its 2
    lines = (partial / "rank-0.jsonl").read_text().splitlines()
    lines[0] = json.dumps({**first, "output": "KEPT"})
    (partial / "rank-0.jsonl").write_text("\n".join(lines) + "\n")
    with open(partial / "rank-1.jsonl", "a") as log:
        log.write('{"index": 0, "outp')  # a line a kill cut short
    status, _, stderr = run_in_process(GENERATE, [*flags, "--resume", "--max_new_tokens", "7"])
    assert status == 2 and "was made with other settings (max_new_tokens)" in stderr
    # rank 0 waits for rank 1's last batch: its collectives recorded, in step, each waiting --ddp_timeout
    resumed = torchrun(2, [FAULTS, GENERATE, *flags, "--resume", "--ddp_timeout", "45"],
                       env={"LEDGER": str(tmp_path / "ledger")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    check_ledger(tmp_path / "ledger", 2, timeout_s=45, device="cpu")  # its group carries host objects
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert two[first["index"]]["output"] == "KEPT"
    two[first["index"]]["output"] = one[first["index"]]["output"]
    assert two == one and len(two) == len(records) and not partial.exists()
    kept = json.dumps(one[first["index"]]["output"], ensure_ascii=False)
    assert (tmp_path / "two.json").read_text().replace('"KEPT"', kept) == (tmp_path / "one.json").read_text()


# -- answers beside their references: the records a run held out, in the formats training reads -------------------
def as_on_own_disks(directory) -> list[str]:
    """A command for `torchrun --no-python` that runs the script after it in `directory`/node-<rank>, as on nodes
    that share no filesystem: a relative --output_file is each process's own."""
    return [sys.executable, "-c", "import os, runpy, sys; node = os.path.join(sys.argv[1], 'node-' + os.environ["
            "'RANK']); os.makedirs(node, exist_ok=True); os.chdir(node); sys.argv = sys.argv[2:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')", str(directory)]


def one_and_two_processes(flags: list, output: Path, directory: Path) -> tuple[bytes, bytes]:
    """The answers file that 1 process (as torchrun runs each) and 2 processes, as on two nodes that share no
    filesystem (the file is process 0's; no partial directory is left on either), write with `flags`. The second
    node holds the partial answers of a killed run with other settings (bfloat16): they are not taken."""
    answers = ["--per_device_batch_size", "1", "--max_new_tokens", "6", "--dtype", "float32"]
    with one_thread():
        status, _, stderr = run_in_process(GENERATE, [*flags, *answers, "--output_file", output])
    assert status == 0, stderr[-3000:]
    stale = directory / "node-1" / "answers.json.partial"
    stale.mkdir(parents=True)
    (stale / "settings.json").write_text(json.dumps({"dtype": "bfloat16"}))
    (stale / "rank-1.jsonl").write_text("".join(json.dumps({"index": index, "output": "stale", "tokens": 1,
                                                            "cut": False}) + "\n" for index in range(30)))
    two = torchrun(2, [*as_on_own_disks(directory), GENERATE, *map(str, flags), *answers, "--output_file",
                       "answers.json"], extra=["--no-python"])
    assert two.returncode == 0, two.stderr[-3000:]
    assert sorted(path.relative_to(directory).as_posix() for path in directory.rglob("*")) == [
        "node-0", "node-0/answers.json", "node-0/answers.summary.json", "node-1"]
    return output.read_bytes(), (directory / "node-0" / "answers.json").read_bytes()


def test_held_out_alpaca_records_are_answered_beside_their_references(reference, tiny_data, tmp_path):
    """The reference runs hold out 15 % of their records (--eval_split_ratio): train.py and train_multigpu.py write
    those records, as training split them, to held_out.jsonl, and --held_out answers exactly those, each output
    beside its record's output as `reference`; 1 and 2 processes write the same bytes."""
    run = reference / "single"
    _, held_out = load_splits(str(tiny_data), eval_split_ratio=0.15, seed=42)
    written = [json.loads(line) for line in (run / HELD_OUT_FILE).read_text().splitlines()]
    assert written == held_out.to_list() and len(written) == 4
    assert (reference / "ddp" / HELD_OUT_FILE).read_bytes() == (run / HELD_OUT_FILE).read_bytes()
    one, two = one_and_two_processes(["--reft_dir", run, "--held_out"], tmp_path / "one.json", tmp_path / "two")
    assert one == two
    rows = json.loads(one)
    assert [(row["instruction"], row.get("input", ""), row["reference"]) for row in rows] == [
        (record["instruction"], record["input"], record["output"]) for record in written]
    assert {row["dataset"] for row in rows} == {"held_out"} and all(row["output"] for row in rows)


def conversations(count: int) -> list[list[dict]]:
    """`count` conversations of the shipped sample's records, every third of two exchanges (the first answer then
    a turn of the prompt)."""
    records = mixed_records()
    turns = [[{"role": "user", "content": r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")},
              {"role": "assistant", "content": r["output"]}] for r in records]
    return [turns[i] + (turns[i + count] if i % 3 == 0 else []) for i in range(count)]


def test_held_out_conversations_are_answered_beside_their_references(tiny_chat_model, tmp_path):
    """A chat run trained on a ShareGPT file (a system prompt in some records) with --eval_split_ratio writes the
    conversations it held out as `messages`; --held_out answers each from the turns before its last and writes
    that assistant turn as `reference`; the same conversations in ShareGPT's format are answered alike, and
    1 and 2 processes write the same bytes."""
    roles = {"user": "human", "assistant": "gpt"}
    sharegpt = [{"conversations": [{"from": roles[turn["role"]], "value": turn["content"]} for turn in turns],
                 **({"system": "Answer briefly."} if index % 2 else {})}
                for index, turns in enumerate(conversations(12))]
    data = tmp_path / "chats.json"
    data.write_text(json.dumps(sharegpt))
    run = tmp_path / "chat-run"
    status, _, stderr = run_in_process("train.py", training_flags(
        tiny_chat_model, data, run, "--prompt_template", "chat", "--max_steps", "1", "--eval_split_ratio", "0.25",
        "--num_sample_answers", "0"))
    assert status == 0, stderr[-3000:]
    written = [json.loads(line)["messages"] for line in (run / HELD_OUT_FILE).read_text().splitlines()]
    expected = [canonical_records(Dataset.from_list([record]), "chats")[0]["messages"] for record in sharegpt]
    assert len(written) == 3 and all(turns in expected for turns in written)
    assert any(turns[0]["role"] == "system" for turns in written) and any(len(turns) > 3 for turns in written)

    one, two = one_and_two_processes(["--reft_dir", run, "--held_out"], tmp_path / "one.json", tmp_path / "two")
    assert one == two
    rows = json.loads(one)
    assert [(row["instruction"], row["reference"]) for row in rows] == [
        (turns[-2]["content"], turns[-1]["content"]) for turns in written]
    held_out_sharegpt = tmp_path / "sharegpt" / "held_out.json"  # the file's name is the answers' `dataset`
    held_out_sharegpt.parent.mkdir()
    held_out_sharegpt.write_text(json.dumps([sharegpt[expected.index(turns)] for turns in written]))
    with one_thread():
        answer_file(run, held_out_sharegpt, tmp_path / "sharegpt.json", "--per_device_batch_size", "1")
    assert (tmp_path / "sharegpt.json").read_bytes() == one


class Killed(Exception):
    """A generation stopped after its first batch (its answers appended to the partial directory)."""


def test_a_resume_is_bound_to_the_resolved_dtype_and_the_interventions_content(runs, untrained, eval_file, tmp_path,
                                                                                monkeypatch):
    """A generation stopped after its first batch with --dtype auto (float32 on a CPU) resumes with --dtype
    float32, what auto resolved to, into the uninterrupted run's file; it is refused with bfloat16, and with other
    interventions in the same --reft_dir."""
    import alpaca.generation

    run = shutil.copytree(runs[0] / "single", tmp_path / "run")
    path, records = eval_file
    flags = ["--reft_dir", run, "--instructions_file", path, "--output_file", tmp_path / "answers.json",
             "--per_device_batch_size", "3", "--max_new_tokens", "6"]
    generate_batch = alpaca.generation.generate_batch

    def stopped_after_the_first_batch(*args, **kwargs):
        if (tmp_path / "answers.json.partial" / "rank-0.jsonl").stat().st_size:
            raise Killed
        return generate_batch(*args, **kwargs)

    monkeypatch.setattr(alpaca.generation, "generate_batch", stopped_after_the_first_batch)
    with pytest.raises(Killed):
        run_in_process(GENERATE, [*flags, "--dtype", "auto"])
    monkeypatch.setattr(alpaca.generation, "generate_batch", generate_batch)
    status, _, stderr = run_in_process(GENERATE, [*flags, "--dtype", "bfloat16", "--resume"])
    assert status == 2 and "was made with other settings (dtype)" in stderr, stderr[-3000:]
    for name in ["config.json", *(path.name for path in untrained.glob("intkey_*.bin"))]:
        shutil.copy(untrained / name, run)  # other weights, the same path
    status, _, stderr = run_in_process(GENERATE, [*flags, "--dtype", "float32", "--resume"])
    assert status == 2 and "was made with other settings (interventions_sha256)" in stderr, stderr[-3000:]
    shutil.copytree(runs[0] / "single", run, dirs_exist_ok=True)
    status, _, stderr = run_in_process(GENERATE, [*flags, "--dtype", "float32", "--resume"])
    assert status == 0, stderr[-3000:]
    answer_file(run, path, tmp_path / "uninterrupted.json")
    rows = json.loads((tmp_path / "answers.json").read_text())
    assert rows == json.loads((tmp_path / "uninterrupted.json").read_text()) and len(rows) == len(records)


# -- what --held_out and --instructions_file read, and how their faults are named ---------------------------------
@pytest.fixture(scope="module")
def generate_module() -> dict:
    """examples/generate.py's functions (runpy: it is a script, not a module)."""
    return runpy.run_path(GENERATE)


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


# Conversations training takes (the last turn the assistant's) whose turn before it is not the user's.
NOT_AFTER_A_USER_TURN = [
    [turn("user", "What is 2 + 2?"), turn("assistant", "calc(2 + 2)"), turn("tool", "4"), turn("assistant", "4.")],
    [turn("user", "Greet me twice."), turn("assistant", "Hello."), turn("assistant", "Hello again.")],
    [turn("system", "Always say yes."), turn("assistant", "Yes.")],
]


@pytest.mark.fast
def test_every_conversation_training_takes_is_answered_from_training_s_prompt(generate_module, chat_tokenizer,
                                                                               tmp_path):
    """Tool use, two assistant turns in a row, [system, assistant]: training takes them; generate.py answers each
    from the very prompt tokens training gives it (the turns before its last), that last turn its reference."""
    path = tmp_path / HELD_OUT_FILE
    path.write_text("".join(json.dumps({"messages": turns}) + "\n" for turns in NOT_AFTER_A_USER_TURN))
    assert load_records(str(path))["messages"] == NOT_AFTER_A_USER_TURN  # training takes them
    items = generate_module["read_instructions"](str(path), "--held_out")
    assert [(item["instruction"], item["reference"]) for item in items] == [
        (turns[:-1], turns[-1]["content"]) for turns in NOT_AFTER_A_USER_TURN]
    prompts, _ = prompt_ids(chat_tokenizer, [item["instruction"] for item in items], [""] * len(items), "chat")
    assert prompts == [conversation_tokens(chat_tokenizer, turns)[0] for turns in NOT_AFTER_A_USER_TURN]


@pytest.mark.fast
@pytest.mark.parametrize("records, message", [
    # three conversations to answer (no reference), then one whose reference has no string content
    ([{"messages": [turn("user", f"Question {i}")]} for i in range(3)]
     + [{"messages": [turn("user", "Q"), {"role": "assistant", "content": 7}]}],
     "record 3 of --instructions_file {path!r}: every message needs a string 'role' and 'content'"),
    # bare instructions, then a conversation that ends with a tool's turn
    (["Name a color.", "Name a fruit.", "Name a tree.",
      {"messages": [turn("user", "Q"), turn("assistant", "calc()"), turn("tool", "4")]}],
     "record 3 of --instructions_file {path!r} ends with a 'tool' message; it should end with the assistant's or "
     "the user's turn"),
], ids=["among-references", "among-conversations"])
def test_a_fault_names_the_record_s_index_in_the_file(generate_module, tmp_path, records, message):
    path = tmp_path / "records.json"
    path.write_text(json.dumps(records))
    with pytest.raises(UsageError) as error:
        generate_module["read_instructions"](str(path))
    assert str(error.value).startswith(message.format(path=str(path))), error.value


def write_run(directory: Path, eval_split_ratio: float | None, held_out: bool) -> Path:
    """A run's output_dir as generate.py reads it before a model loads: its arguments, and its held-out records."""
    directory.mkdir(parents=True)
    settings = {"model_name_or_path": "none", "position": "f1+l1", "share_weights": False,
                "prompt_template": "chat", "model_max_length": 64, "eval_split_ratio": eval_split_ratio}
    (directory / "training_args.json").write_text(json.dumps(settings))
    if held_out:
        (directory / HELD_OUT_FILE).write_text(json.dumps({"messages": NOT_AFTER_A_USER_TURN[0]}) + "\n")
    return directory


def test_held_out_reads_only_its_run_s_file(generate_module, tmp_path):
    """A run's held_out.jsonl is found from the run and from a checkpoint of it; a file of that name one directory up
    (a user's own, another run's) is never answered in its stead: one line says why the run has none (trained
    without --eval_split_ratio, by a train.py from before the file, or no such run)."""
    held_out_file = generate_module["held_out_file"]
    run = write_run(tmp_path / "run", 0.2, held_out=True)
    (run / "checkpoint-3").mkdir()
    assert held_out_file(str(run)) == held_out_file(str(run / "checkpoint-3")) == run / HELD_OUT_FILE
    write_run(run / "nested", None, held_out=False)
    write_run(run / "older", 0.2, held_out=False)
    for directory, problem in (
            ("nested", f"the run {str(run / 'nested')!r} was trained without --eval_split_ratio, so it held no "
                       "records out"),
            ("older", f"the run {str(run / 'older')!r} was trained with --eval_split_ratio 0.2 by a train.py from "
                      "before it wrote the held-out records to held_out.jsonl"),
            ("mistyped", f"--reft_dir {str(run / 'mistyped')!r} does not exist: there is no such run")):
        status, _, stderr = run_in_process(GENERATE, ["--reft_dir", run / directory, "--held_out", "--output_file",
                                                      tmp_path / "answers.json"])
        assert status == 2 and len(stderr.strip().splitlines()) == 1, stderr[-3000:]
        assert problem in stderr and "Traceback" not in stderr, stderr
    assert not (tmp_path / "answers.json").exists()
