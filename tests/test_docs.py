"""Every command shown in README.md and docs/ is one that the tests or the launch recipes run.

The scripts' command lines are parsed by the scripts' own parsers (a renamed or removed flag fails here); the
README's pyreft command line is the one `tests/conftest.py` trains with; launcher flags are those of a launch
recipe that tests/test_recipes.py runs; any other kind of command fails this test until a test runs it."""

import re
import shlex
import sys
from pathlib import Path

import pytest
from conftest import documented_commands

from alpaca.args import build_parser

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = {"train.py": False, "train_multigpu.py": True}  # name: multigpu
LAUNCHERS = {("torchrun",), ("srun", "torchrun"), ("accelerate", "launch")}


def script_arguments(tokens: list[str]) -> list[str]:
    """A documented command's script arguments: the placeholders `...` and the brackets of optional flags
    dropped."""
    return [token.strip("[]") for token in tokens if token != "..." and token.strip("[]")]


def recipes_run_by_tests() -> str:
    return (REPO / "tests" / "test_recipes.py").read_text()


def check_command(command: str) -> None:
    tokens = shlex.split(command)
    while tokens and re.fullmatch(r"[A-Z_]+=\S*", tokens[0]):  # environment assignments
        tokens = tokens[1:]
    if tokens[:1] == ["make"]:
        assert tokens[1] in ("train", "test", "test-fast"), tokens
        assert re.search(rf"^{tokens[1]}:", (REPO / "Makefile").read_text(), re.M)
        return
    if tokens[:2] == ["pip", "install"]:  # what `make` installs, the same way
        makefile = (REPO / "Makefile").read_text()
        requirements = [tokens[i + 1] for i, token in enumerate(tokens) if token == "-r"]
        for name in requirements:
            assert (REPO / name).exists(), name
            assert ("--no-deps" in tokens) == (f"--no-deps -r {name}" in makefile) or name == "requirements.txt"
        if not requirements:
            dev = (REPO / "requirements-dev.txt").read_text()
            assert all(re.search(rf"^{package}==", dev, re.M) for package in tokens[2:]), tokens
        return
    if tokens[0] == "sbatch" or any(token.startswith("examples/launch/") for token in tokens):
        recipe = next(token for token in tokens if token.startswith("examples/launch/"))
        assert (REPO / recipe).exists() and Path(recipe).name in recipes_run_by_tests(), recipe
        build_parser("train_multigpu.py", True).parse_args(script_arguments(tokens[tokens.index(recipe) + 1:]))
        return
    script_index = next((i for i, token in enumerate(tokens) if token in SCRIPTS or token.startswith(
        ("examples/", "benchmarks/"))), None)
    assert script_index is not None, f"no test runs a command like this: {command}"
    launcher, script = tokens[:script_index], tokens[script_index]
    arguments = script_arguments(tokens[script_index + 1:])
    if launcher != ["python"]:
        launcher_name = next((name for name in LAUNCHERS if tuple(launcher[: len(name)]) == name), None)
        assert launcher_name is not None, f"no test runs a command like this: {command}"
        recipes = "\n".join(p.read_text() for p in (REPO / "examples" / "launch").iterdir())
        flags = [token for token in launcher[len(launcher_name):] if token.startswith("--")]
        assert launcher_name[-1] in recipes, launcher
        assert all(flag in recipes for flag in flags), f"launcher flags no recipe uses: {command}"
    if script in SCRIPTS:
        build_parser(script, SCRIPTS[script]).parse_args(arguments)
    elif script == "examples/generate.py":
        sys.path.insert(0, str(REPO / "examples"))
        import generate

        generate.parse_args(arguments)
    elif script == "benchmarks/llama70b_nf4.py":  # its own flags, then train.py's
        sys.path.insert(0, str(REPO / "benchmarks"))
        import llama70b_nf4

        build_parser("train.py", False).parse_args(llama70b_nf4.parse_own_flags(arguments)[1])
    else:
        assert script.startswith("benchmarks/") and (REPO / script).exists(), script
        source = (REPO / script).read_text()
        for flag in (token for token in arguments if token.startswith("--")):
            assert f'"{flag}"' in source, f"{script} has no flag {flag}"


# docs/adapting.md's commands need its diffs applied: tests/test_adapting.py runs each in a patched copy.
@pytest.mark.parametrize("page, command", [(page, command) for page, command in documented_commands()
                                           if page != "adapting.md"], ids=lambda value: value[:60])
def test_documented_command_is_one_the_tests_run(page, command):
    check_command(command)


def test_the_check_refuses_a_removed_flag_and_an_unknown_command():
    with pytest.raises(SystemExit):
        check_command("python train.py --no_such_flag 1")
    with pytest.raises(AssertionError, match="no test runs"):
        check_command("python some_other_script.py --x")
    with pytest.raises(AssertionError, match="launcher flags"):
        check_command("torchrun --log_dir logs train_multigpu.py ...")
