"""The two scripts as a lesson: `diff train.py train_multigpu.py` shows what N processes add and nothing
else, so a change to the part both share, made in one script only, fails here. Both have the same functions
in the same order, none of which takes more than 6 positional arguments nor runs past 120 lines (a screen per
idea, as nanoGPT's); no call in them passes more than 6 values in a row (past six, name them)."""

import ast
import difflib
import re

import pytest
from conftest import REPO

pytestmark = pytest.mark.fast

SCRIPTS = ("train.py", "train_multigpu.py")
MAX_CHANGED_LINES = 150
MAX_POSITIONAL = 6
MAX_FUNCTION_LINES = 120
# What N processes add to one process's training: every hunk of the diff names one of these, on either side.
# `rank` alone is the process's (args.rank is LoReFT's low-rank dimension); `process` covers the process group.
DISTRIBUTED = re.compile(
    r"(?<!args\.)\brank\b|\branks\b|local_rank|non_main_rank|world_size|num_replicas|\bprocess(es)?\b|"
    r"process_group|process_gpus|\btorchrun\b|\bdist\.|\bplaceholders?\b|\bis_main\b|\brun_checked\b|"
    r"main_rank_result|first_on_local_main|gather|all_reduce|\bbarrier\b|\bbackend\b|shards_base|multigpu|"
    r"fork_rng")


def hunks(before: list[str], after: list[str]) -> list[tuple[str, list[str], list[str]]]:
    """The diff's hunks as `diff` prints them: (its header, train.py's lines, train_multigpu.py's lines)."""
    matcher = difflib.SequenceMatcher(None, before, after, autojunk=False)
    return [(f"{i1 + 1},{i2}{tag[0]}{j1 + 1},{j2}", before[i1:i2], after[j1:j2])
            for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]


def unexplained(before: list[str], after: list[str]) -> list[str]:
    """The hunks that name no distributed concept and are not imports alone (an import follows from a line
    that uses it, which the diff shows too)."""
    def imports_only(lines: list[str]) -> bool:
        return all(re.match(r"\s*(from \S+ import|import \S|[\w, ]+,?$|\)$)", line) or not line.strip()
                   for line in lines)

    return [f"{header}: {[*old, *new]}" for header, old, new in hunks(before, after)
            if not any(DISTRIBUTED.search(line) for line in [*old, *new]) and not imports_only([*old, *new])]


def changed_lines(before: list[str], after: list[str]) -> int:
    return sum(len(old) + len(new) for _, old, new in hunks(before, after))


def script_lines(name: str) -> list[str]:
    return (REPO / name).read_text().splitlines()


def functions(name: str) -> list[ast.FunctionDef]:
    return [node for node in ast.walk(ast.parse((REPO / name).read_text())) if isinstance(node, ast.FunctionDef)]


def test_the_diff_of_the_scripts_is_what_n_processes_add():
    train, multigpu = (script_lines(name) for name in SCRIPTS)
    changed = changed_lines(train, multigpu)
    for header, old, new in hunks(train, multigpu):
        print(header, *(f"< {line}" for line in old), *(f"> {line}" for line in new), sep="\n")
    assert changed <= MAX_CHANGED_LINES, f"diff train.py train_multigpu.py: {changed} changed lines"
    assert unexplained(train, multigpu) == [], "hunks that name no distributed concept"


@pytest.mark.parametrize("shared, changed", [
    ("                window_start += evaluated[\"eval_s\"]  # tokens/s counts training time only",
     "                window_start += 0.0"),
    ("    reft_model = build_reft_model(model, args.layers, position, args.share_weights,",
     "    reft_model = build_reft_model(model, args.layers, position, False,"),
])
def test_a_change_to_the_shared_part_in_one_script_only_fails_the_diff_check(shared, changed):
    """The check above can fail: a shared line changed in train.py alone is a hunk that names nothing
    distributed (the second names LoReFT's `args.rank` on the line after it, which is not the process's). A
    change next to a distributed hunk joins it, as `diff` shows it: the hunk's size still counts."""
    train, multigpu = (script_lines(name) for name in SCRIPTS)
    assert train.count(shared) == multigpu.count(shared) == 1
    edited = [changed if line == shared else line for line in train]
    assert unexplained(train, multigpu) == []
    assert len(unexplained(edited, multigpu)) == 1


def test_the_scripts_have_the_same_functions_in_the_same_order():
    assert [f.name for f in functions("train.py")] == [f.name for f in functions("train_multigpu.py")]


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_function_of_a_script_takes_more_than_six_positional_arguments(name):
    too_many = {f.name: len(f.args.posonlyargs) + len(f.args.args) for f in functions(name)
                if len(f.args.posonlyargs) + len(f.args.args) > MAX_POSITIONAL}
    assert too_many == {}


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_call_in_a_script_passes_more_than_six_positional_arguments(name):
    calls = [node for node in ast.walk(ast.parse((REPO / name).read_text())) if isinstance(node, ast.Call)]
    too_many = {f"line {call.lineno}: {ast.unparse(call.func)}": len(call.args) for call in calls
                if len(call.args) > MAX_POSITIONAL}
    assert too_many == {}


@pytest.mark.parametrize("name", SCRIPTS)
def test_no_function_of_a_script_runs_past_120_lines(name):
    """Nested functions count in the function that holds them."""
    too_long = {f.name: f.end_lineno - f.lineno + 1 for f in functions(name)
                if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES}
    assert too_long == {}


@pytest.mark.parametrize("name", [*SCRIPTS, *(str(path.relative_to(REPO)) for path in (REPO / "alpaca").glob("*.py"))])
def test_the_process_rank_and_the_low_rank_dimension_never_share_a_name_in_a_function(name):
    """`rank` is the process's rank wherever it is a variable or an argument; in no function does `args.rank`
    (LoReFT's low-rank dimension, pyreft's flag name) sit next to it."""
    both = []
    for function in functions(name):
        names = {node.id for node in ast.walk(function) if isinstance(node, ast.Name)}
        names |= {arg.arg for arg in ast.walk(function) if isinstance(arg, ast.arg)}
        lorefts = any(isinstance(node, ast.Attribute) and node.attr == "rank" and isinstance(node.value, ast.Name)
                      and node.value.id == "args" for node in ast.walk(function))
        if "rank" in names and lorefts:
            both.append(function.name)
    assert both == []
