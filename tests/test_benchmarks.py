"""The benchmarks for a GPU lease: benchmarks/throughput.py cut short keeps the rows it measured; the 70B NF4 base
builds where it runs and trains within its memory formula (at 2 layers on the CPU); gpu_check.sh's sections start,
print and stop at their budget on a CPU rehearsal with a fake nvidia-smi."""

import os
import re
import subprocess
import sys
import time

from conftest import LAYERS, REPO, run_script


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


def test_llama70b_nf4_builds_layers_of_70b_widths_and_trains_them_within_the_memory_formula(tiny_model, tiny_data,
                                                                                             tmp_path):
    """benchmarks/llama70b_nf4.py at 2 layers of Llama-3.1-70B's widths (the tiny tokenizer's vocabulary): train.py's
    loop trains the built NF4 base as a --load_in_4bit one, backward through a 70B-wide layer (intervened on layer
    0), and the peak resident memory since the build is at least the NF4 layers and at most its formula: a
    full-precision copy of the layers (3.2 GiB in bf16) would exceed it. It computes in float32: on a CPU without
    bf16 matrix kernels one bf16 matmul of these widths takes a minute."""
    command = [sys.executable, str(REPO / "benchmarks" / "llama70b_nf4.py"), "--num_hidden_layers", "2",
               "--vocab_size", "512", "--dtype", "float32", "--model_name_or_path", str(tiny_model), "--data_path",
               str(tiny_data), "--output_dir", str(tmp_path / "out"), "--max_steps", "2", "--logging_steps", "1",
               "--per_device_train_batch_size", "1", "--model_max_length", "128", "--layers", "0", "--position", "l1",
               "--intervention", "noreft", "--num_sample_answers", "0"]  # noreft: LoReFT's init at 8192 takes a minute
    result = run_script(command[1:], timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    hidden, intermediate, heads, kv_heads, head_dim = 8192, 28672, 64, 8, 128
    per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * intermediate
    parameters = 2 * per_layer + 2 * 512 * hidden + 5 * hidden  # + embeddings, LM head, 2 norms a layer and the last
    assert f"base model {parameters:,} parameters (4-bit nf4, computing in torch.float32)" in result.stdout
    assert "Trained to step 2 in" in result.stdout
    assert sorted(path.name for path in (tmp_path / "out").glob("intkey_*")) == ["intkey_layer_0_comp_block_output_"
                                                                                  "unit_pos_nunit_1#0.bin"]
    memory = re.search(r"growth ([\d.]+) GiB; .*: ([\d.]+) GiB \(nf4 layers ([\d.]+),", result.stdout)
    assert memory, result.stdout[-2000:]
    measured, formula, nf4_layers = map(float, memory.groups())
    assert nf4_layers <= measured <= formula


def test_gpu_check_sections_10_and_11_start_print_and_stop_at_their_budget_on_a_rehearsal(tiny_model, tiny_data,
                                                                                        tmp_path):
    """benchmarks/gpu_check.sh on the CPU with a fake nvidia-smi, each run cut at RUN_SECONDS: section 10's six
    strategies under torchrun and section 11's 70B build (2 layers here) each start, print one verdict line, and stop
    at the budget; the section headers come in order after the fake GPU's line."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'NVIDIA H200 (fake), 143771 MiB, 570.00'\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    env = {"PATH": f"{fake_bin}:{os.environ['PATH']}", "PYTHON": sys.executable, "MODEL": str(tiny_model),
           "DATA": str(tiny_data), "OUT": str(tmp_path / "out"), "SECTIONS": "10 11", "SECTION_SECONDS": "100",
           "RUN_SECONDS": "5", "NF4_70B_SHAPE": "--num_hidden_layers 2 --vocab_size 512 --layers 0"}
    started = time.monotonic()
    result = run_script(["benchmarks/gpu_check.sh"], env=env, launcher=["bash"], timeout=240)
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    headers = [line.split()[1] for line in lines if line.startswith("=== ")]
    assert headers == ["environment", "10.", "11."]
    assert "NVIDIA H200 (fake), 143771 MiB, 570.00" in lines
    names = ["nccl-ddp", "nccl-fsdp", "nccl-fsdp-offload", "nccl-zero2", "nccl-zero3", "nccl-zero3_offload",
             "llama70b-nf4"]
    verdicts = [line for line in lines if line.split(":")[0] in names]
    assert [line.split(":")[0] for line in verdicts] == names
    refused_on_a_cpu = ("nccl-fsdp-offload", "nccl-zero3_offload")  # offload is for GPUs: one line, if within 5 s
    assert all(line.endswith("timed out after 5 s)") or re.search(r": passed( \(\d+ collectives in step\))?$", line)
               or line.startswith(refused_on_a_cpu) and line.endswith(": failed (exit 1)")
               for line in verdicts), "\n".join(verdicts)
    assert all((tmp_path / "out" / f"{name}.log").is_file() for name in names)
    assert elapsed < len(names) * (5 + 5) + 30  # each stopped at its 5 s (+ the kill's and bash's seconds)
