"""benchmarks/throughput.py on a GPU lease: a run cut short keeps the rows it measured."""

import subprocess
import sys

from conftest import LAYERS, REPO


def throughput(tiny_model, tiny_data, *flags) -> tuple[subprocess.Popen, list[str]]:
    """Run benchmarks/throughput.py on the tiny model; return the finished process and its lines, each checked,
    as it came, for whether the process was still running then (a row printed while the next is measured)."""
    command = [sys.executable, str(REPO / "benchmarks" / "throughput.py"), "--model_name_or_path", str(tiny_model),
               "--data_path", str(tiny_data), "--num_examples", "8", "--min_steps", "2", "--repeats", "1",
               "--layers", LAYERS, *flags]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as run:
        lines = [(line.rstrip("\n"), run.poll() is None) for line in run.stdout]
        stderr = run.stderr.read()
    assert run.returncode == 0, stderr[-3000:]
    return run, lines


def rows(lines: list[tuple[str, bool]]) -> list[list[str]]:
    return [line.split()[:2] for line, _ in lines if line.split()[:1] in (["4"], ["2"])]


def test_throughput_prints_each_row_as_it_is_measured_and_goes_on_past_a_failed_variant(tiny_model, tiny_data):
    """The baseline's row is out before the next variant runs; a variant that fails (varlen needs CUDA) is a row
    with its error's last lines, and the variants after it are still measured, with their ratio to the baseline."""
    _, lines = throughput(tiny_model, tiny_data, "--batch_sizes", "4", "--variants", "baseline,varlen,eager")
    assert rows(lines) == [["4", "baseline"], ["4", "varlen"], ["4", "eager"]]
    assert all(running for line, running in lines if line.split()[:2] == ["4", "baseline"])
    failed = next(index for index, (line, _) in enumerate(lines) if line.split()[:2] == ["4", "varlen"])
    assert lines[failed][0].split()[2:4] == ["failed", "(exit"]
    error_lines = [line for line, _ in lines[failed + 1:-1]]
    assert error_lines and "runs torch's varlen flash kernel, on CUDA GPUs" in error_lines[-1]
    ratio = lines[-1][0].split()[6]
    assert ratio.endswith("x") and float(ratio[:-1]) > 0


def test_throughput_starts_no_variant_past_its_time_budget(tiny_model, tiny_data):
    """With --time_budget spent after the first variant, the run ends with its row and names what it did not start."""
    _, lines = throughput(tiny_model, tiny_data, "--batch_sizes", "4,2", "--variants", "baseline,eager",
                          "--time_budget", "1")
    assert rows(lines) == [["4", "baseline"]]
    assert lines[-1][0] == "time budget of 1 s spent; not started: eager at 4, baseline at 2, eager at 2"
