"""Checkpoints are verified before use: no code runs from a file, damage is detected, a failed write is said
plainly and loses nothing."""

import json
import os
import re
import shutil

import pytest
import torch
from conftest import (
    DDP,
    EACH_RANK_ENDS_ON_ITS_OWN,
    FAULTS,
    LAYERS,
    REPO,
    SINGLE,
    assert_every_rank_left_on_its_own,
    assert_same_run,
    copy_as_killed,
    flags,
    intervention_weights,
    run_in_process,
    torchrun,
    training_flags,
    workers_output,
)
from faults import Fault

import alpaca.checkpoint
from alpaca.checkpoint import checkpoints, is_complete, latest_checkpoint, load_checkpoint, tensor_bytes
from alpaca.errors import UsageError
from alpaca.manifest import MANIFEST, sha256
from alpaca.output import FINISHED_FILE


class RunsCode:
    """Pickles as a call to os.system, as a malicious checkpoint would."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def rewrite(checkpoint, name: str, data: bytes) -> None:
    """Replace a file and update the manifest's size and SHA-256, as someone crafting a checkpoint would."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": sha256(checkpoint / name)}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def malicious_pickle(marker, payload: dict) -> bytes:
    path = marker.parent / "payload.pt"
    torch.save({**payload, "extra": RunsCode(marker)}, path)
    return path.read_bytes()


@pytest.fixture(scope="session")
def killed_run(reference, tmp_path_factory):
    """What train.py killed during step 8 leaves (global batch 8, a checkpoint every 2 steps): checkpoints 2, 4 and 6
    of the reference run, no output. (Killing it for real: test_resume.py.)"""
    directory = copy_as_killed(reference / "single", tmp_path_factory.mktemp("killed"), 6)
    assert [path.name for path in checkpoints(directory)] == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    return directory


def test_a_pickled_callable_in_a_checkpoint_never_runs(tiny_model, tiny_data, tmp_path, killed_run):
    shutil.copytree(killed_run, tmp_path / "run")
    checkpoint, marker = tmp_path / "run" / "checkpoint-6", tmp_path / "marker"
    tensors = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    rewrite(checkpoint, "trainer_state.pt", malicious_pickle(marker, tensors))
    assert is_complete(checkpoint)  # the manifest was forged too: only the weights-only load stands in the way
    status, _, stderr = run_in_process("train.py", [*flags(tiny_model, tiny_data, tmp_path / "run", *SINGLE),
                                                    "--resume_from_checkpoint", checkpoint])
    assert status == 2
    assert "could run code when loaded; it is not loaded" in stderr.strip().splitlines()[-1]
    assert not marker.exists()


def test_the_intervention_states_are_loaded_weights_only_too(tmp_path, killed_run):
    shutil.copytree(killed_run / "checkpoint-6", tmp_path / "checkpoint-6")
    checkpoint, marker = tmp_path / "checkpoint-6", tmp_path / "marker"
    states = torch.load(checkpoint / "interventions.pt", weights_only=True)
    rewrite(checkpoint, "interventions.pt", malicious_pickle(marker, states))
    with pytest.raises(UsageError, match="could run code"):
        load_checkpoint(checkpoint)
    assert not marker.exists()


def test_a_checkpoint_in_an_older_manifest_format_is_refused_unread(tmp_path, killed_run, capsys, monkeypatch):
    """A manifest of sizes only, with no SHA-256s (as an older version of these scripts wrote it, next to a trainer
    state that was a full pickle): named, the checkpoint is refused in one line saying why; `auto` passes over it,
    with that line as a warning. Nothing in it is unpickled."""
    shutil.copytree(killed_run, tmp_path, dirs_exist_ok=True)
    newest = tmp_path / "checkpoint-6"
    manifest = json.loads((newest / MANIFEST).read_text())
    (newest / MANIFEST).write_text(json.dumps({"step": 6, "files": {name: entry["bytes"] for name, entry in
                                                                    manifest["files"].items()}}))
    loads = []
    monkeypatch.setattr(torch, "load", lambda path, *args, **kwargs: loads.append(path))
    problem = "damaged (manifest.json is not a manifest of this format)"
    refusal = f"--resume_from_checkpoint '{newest}' is {problem}; pass an intact"
    with pytest.raises(UsageError, match=re.escape(refusal)):
        load_checkpoint(newest)
    capsys.readouterr()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    assert capsys.readouterr().err == f"warning: skipping {newest}: {problem}\n"
    assert loads == []


@pytest.mark.parametrize("damaged", ["interventions.pt", "trainer_state.pt", "intkey_*.bin"])
def test_a_damaged_checkpoint_is_refused_and_auto_resume_falls_back(tiny_model, tiny_data, tmp_path, killed_run,
                                                                     reference, damaged):
    """One byte flipped in the middle of a file of the newest checkpoint (same size)."""
    shutil.copytree(killed_run, tmp_path, dirs_exist_ok=True)
    newest = tmp_path / "checkpoint-6"
    file = next(newest.glob(damaged))
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x01
    file.write_bytes(bytes(data))
    with pytest.raises(UsageError, match=f"checkpoint-6' is damaged \\({file.name} does not match its SHA-256"):
        load_checkpoint(newest)
    args = flags(tiny_model, tiny_data, tmp_path, *SINGLE)
    status, stdout, stderr = run_in_process("train.py", [*args, "--resume_from_checkpoint", "auto"])
    assert status == 0, stderr[-3000:]
    assert f"skipping {newest}: damaged ({file.name}" in stderr
    assert "at step 4" in stdout
    assert_same_run(tmp_path, reference / "single", exact=True)


@pytest.mark.fast
def test_a_checkpoint_cut_short_is_incomplete(tmp_path, killed_run):
    shutil.copytree(killed_run / "checkpoint-6", tmp_path / "checkpoint-6")
    state = tmp_path / "checkpoint-6" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(UsageError, match="is incomplete \\(trainer_state.pt is missing or cut short\\)"):
        load_checkpoint(tmp_path / "checkpoint-6")


def failed_run(processes: int, mode: str, step: int, tiny_model, tiny_data, output_dir) -> tuple[int, str]:
    """(exit status, stderr) of a run whose write fails (tests/faults.py's `mode` at `step`): train.py in this
    process, or train_multigpu.py on 2 ranks, where rank 1 must learn it from rank 0 and each rank leave on its
    own instead of waiting in the next collective for --ddp_timeout."""
    if processes == 1:
        with Fault(mode, step):
            status, _, stderr = run_in_process("train.py", flags(tiny_model, tiny_data, output_dir, *SINGLE))
        return status, stderr
    failed = torchrun(2, [FAULTS, "train_multigpu.py", *flags(tiny_model, tiny_data, output_dir, *DDP),
                          "--ddp_timeout", "600"], env={"FAULT": mode, "FAULT_STEP": str(step)},
                      extra=EACH_RANK_ENDS_ON_ITS_OWN, timeout=180)
    assert_every_rank_left_on_its_own(failed.stderr)
    return failed.returncode, failed.stderr


@pytest.mark.parametrize("processes", [1, 2])
def test_a_full_disk_ends_the_run_with_one_line_and_resume_is_exact(tiny_model, tiny_data, tmp_path, reference,
                                                                   processes):
    """The write of checkpoint-4 (the second) fails half-way with ENOSPC on rank 0; on 2 processes each rank
    leaves on its own, and the same files remain. The resume after it is the one process's (rank 0 alone writes
    and reads checkpoints; an exact 2-process resume: test_resume.py)."""
    status, stderr = failed_run(processes, "enospc", 4, tiny_model, tiny_data, tmp_path)
    assert status != 0
    # rank 0's, once (torchrun's summary repeats it as the root cause where rank 0 failed first)
    [message] = [line for line in workers_output(stderr).splitlines() if "error: writing" in line]
    assert f"writing {tmp_path / 'checkpoint-4'} failed: No space left on device" in message
    assert f"The newest intact checkpoint is {tmp_path / 'checkpoint-2'}" in message
    assert "--resume_from_checkpoint auto" in message
    assert "alpaca/" not in stderr  # no traceback from the scripts (torchrun prints its own summary)
    assert [path.name for path in tmp_path.iterdir() if "staging" in path.name] == []
    assert [path.name for path in checkpoints(tmp_path)] == ["checkpoint-2"] and is_complete(tmp_path / "checkpoint-2")
    if processes == 2:
        return
    (tmp_path / ".checkpoint-3.staging-12345").mkdir()  # left by a run killed while writing
    status, _, stderr = run_in_process("train.py", [*flags(tiny_model, tiny_data, tmp_path, *SINGLE),
                                                    "--resume_from_checkpoint", "auto"])
    assert status == 0, stderr[-3000:]
    assert not (tmp_path / ".checkpoint-3.staging-12345").exists()
    assert_same_run(tmp_path, reference / "single", exact=True)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_failed_output_write_keeps_the_checkpoints(tiny_model, tiny_data, tmp_path, processes):
    """Writing the final output fails in its first file (a full disk): one line, exit status 1, the checkpoints
    stay and no part of the output is left, nor the record that the run finished (a requeue resumes from the newest
    checkpoint); on 2 processes each rank leaves on its own (the output's write is a call site of its own)."""
    status, stderr = failed_run(processes, "write", 10, tiny_model, tiny_data, tmp_path)
    if processes == 1:
        assert status == 1, stderr[-3000:]
    script = "train.py" if processes == 1 else "train_multigpu.py"
    # rank 0's, once (torchrun's summary repeats it as the root cause where rank 0 failed first)
    [message] = [line for line in workers_output(stderr).splitlines() if "error: writing" in line]
    assert message.startswith(f"{script}: error: writing the output to {tmp_path} failed: No space left on device "
                              "(injected"), stderr[-3000:]
    assert f"The newest intact checkpoint is {tmp_path / 'checkpoint-8'}" in message
    assert "OSError" not in stderr  # one line, not the script's traceback
    assert [path.name for path in checkpoints(tmp_path)] == ["checkpoint-2", "checkpoint-4", "checkpoint-6",
                                                             "checkpoint-8"]
    assert not list(tmp_path.glob("intkey_*.bin")) and not list(tmp_path.glob(".staging*"))
    assert not (tmp_path / FINISHED_FILE).exists()


def test_a_failed_plot_leaves_a_finished_output(tiny_model, tiny_data, tmp_path, monkeypatch):
    """loss.png, drawn from the metrics, comes after the output and the record that the run finished: a plot that
    fails is one line, the run ends as finished and a requeue finds it so."""
    def plot_fails(directory) -> None:
        raise RuntimeError("injected: the plot fails")

    monkeypatch.setattr(alpaca.checkpoint, "plot_loss", plot_fails)
    status, stdout, stderr = run_in_process("train.py", training_flags(tiny_model, tiny_data, tmp_path, "--max_steps",
                                                                       "2", "--num_sample_answers", "0"))
    assert status == 0 and "Trained to step 2" in stdout, stderr[-3000:]
    assert f"loss.png not drawn (RuntimeError: injected: the plot fails); the metrics it shows are in " \
           f"{tmp_path / 'metrics.jsonl'}" in stderr.splitlines()
    assert json.loads((tmp_path / FINISHED_FILE).read_text())["step"] == 2 and list(tmp_path.glob("intkey_*.bin"))


def test_loading_a_trained_output_never_runs_code(tiny_model, tmp_path, killed_run):
    """`load_reft_model` (and so examples/generate.py) on a pyreft-format directory someone crafted."""
    from alpaca.model import load_base_model
    from alpaca.output import load_reft_model

    model, _ = load_base_model(str(tiny_model), torch.float32, torch.device("cpu"))
    shutil.copytree(killed_run / "checkpoint-6", tmp_path / "output")
    output, marker = tmp_path / "output", tmp_path / "marker"
    assert load_reft_model(output, model).interventions  # the untouched directory loads
    config = json.loads((output / "config.json").read_text())
    config["intervention_types"][0] = "<class 'subprocess.Popen'>"
    (output / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match="names intervention classes that are not in INTERVENTIONS"):
        load_reft_model(output, model)
    shutil.copy2(killed_run / "checkpoint-6" / "config.json", output / "config.json")
    binary = next(output.glob("intkey_*.bin"))
    binary.write_bytes(malicious_pickle(marker, torch.load(binary, weights_only=True)))
    with pytest.raises(UsageError, match="could run code when loaded"):
        load_reft_model(output, model)
    assert not marker.exists()


@pytest.mark.fast
def test_every_torch_load_in_the_project_is_weights_only():
    """A full unpickler on a file from disk runs whatever it pickled: every call names weights_only=True."""
    calls = [(path.relative_to(REPO), line) for path in REPO.glob("**/*.py") if ".venv" not in path.parts
             for line in path.read_text().splitlines() if "torch.load(" in line and "def " not in line]
    assert calls and all("weights_only=True" in line for _, line in calls), calls


def sizes_as_numbers(manifest: dict) -> dict:
    return {**manifest, "files": {name: entry["bytes"] for name, entry in manifest["files"].items()}}


def path_outside(manifest: dict) -> dict:
    files = dict(manifest["files"])
    files["../trainer_state.pt"] = files.pop("trainer_state.pt")
    return {**manifest, "files": files}


def without(name: str):
    return lambda manifest: {**manifest, "files": {key: entry for key, entry in manifest["files"].items()
                                                   if key != name}}


MANIFEST_SHAPES = {
    # (how the manifest is rewritten, what the notice says after "damaged (")
    "sizes as plain numbers": (sizes_as_numbers, "manifest.json is not a manifest of this format"),
    "a list": (lambda manifest: list(manifest["files"]), "manifest.json is not a manifest of this format"),
    "no files": (lambda manifest: {**manifest, "files": {}}, "manifest.json is not a manifest of this format"),
    "a size that is text": (lambda manifest: {**manifest, "files": {**manifest["files"], "trainer_state.pt": {
        **manifest["files"]["trainer_state.pt"], "bytes": "1"}}}, "manifest.json is not a manifest of this format"),
    "a path outside": (path_outside, "manifest.json is not a manifest of this format"),
    "a file left out": (without("trainer_state.pt"), "manifest.json does not list trainer_state.pt"),
}


@pytest.mark.fast
@pytest.mark.parametrize("shape", MANIFEST_SHAPES)
def test_a_manifest_of_another_shape_is_damage(tmp_path, killed_run, capsys, shape):
    """Valid JSON, but not the manifest this version writes: the checkpoint is damaged, like one whose file does
    not match its SHA-256 (refused when named, skipped by auto with a warning)."""
    rewritten, problem = MANIFEST_SHAPES[shape]
    shutil.copytree(killed_run, tmp_path, dirs_exist_ok=True)
    newest = tmp_path / "checkpoint-6"
    (newest / MANIFEST).write_text(json.dumps(rewritten(json.loads((newest / MANIFEST).read_text()))))
    with pytest.raises(UsageError, match=f"checkpoint-6' is damaged \\({re.escape(problem)}\\); pass an intact"):
        load_checkpoint(newest)
    capsys.readouterr()
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoint-4"
    assert capsys.readouterr().err == f"warning: skipping {newest}: damaged ({problem})\n"


def test_auto_resume_past_a_manifest_of_another_shape_is_exact(tiny_model, tiny_data, tmp_path, killed_run,
                                                               reference):
    """File sizes as plain numbers in the newest checkpoint's manifest: the run resumes from the one before."""
    shutil.copytree(killed_run, tmp_path, dirs_exist_ok=True)
    manifest_file = tmp_path / "checkpoint-6" / MANIFEST
    manifest_file.write_text(json.dumps(sizes_as_numbers(json.loads(manifest_file.read_text()))))
    status, stdout, stderr = run_in_process("train.py", [*flags(tiny_model, tiny_data, tmp_path, *SINGLE),
                                                         "--resume_from_checkpoint", "auto"])
    assert status == 0, stderr[-3000:]
    assert f"skipping {tmp_path / 'checkpoint-6'}: damaged (manifest.json is not a manifest" in stderr
    assert "at step 4" in stdout
    assert_same_run(tmp_path, reference / "single", exact=True)


def test_a_checkpoint_with_a_bf16_learned_source_resumes_in_float32(tiny_model, tiny_data, tmp_path):
    """Before interventions were float32 on every base, a bf16 run checkpointed LoReFT's learned source and its
    AdamW moments in bf16 (the rotation was float32 already). Such a checkpoint resumes: torch's load_state_dict
    copies them into the float32 parameters and state, and the run ends near the one that was float32
    throughout: one rounding to bf16 at step 4 apart (0.1-0.3 % of each tensor, measured), against the 5-20 %
    that steps 5-9 move each."""
    from alpaca.model import build_reft_model, intervention_parameters, load_base_model
    from alpaca.optim import optimizer_param_groups

    run = tmp_path / "run"
    status, _, stderr = run_in_process("train.py", flags(tiny_model, tiny_data, run, *SINGLE, "--dtype", "bfloat16"))
    assert status == 0, stderr[-3000:]
    old = copy_as_killed(run, tmp_path / "old", 4)
    checkpoint = old / "checkpoint-4"
    base, _ = load_base_model(str(tiny_model), torch.bfloat16, torch.device("cpu"))
    reft_model = build_reft_model(base, LAYERS, (2, 2), False, low_rank_dimension=4)
    names = {id(parameter): name for name, parameter in intervention_parameters(reft_model)}
    order = [names[id(parameter)] for group in optimizer_param_groups(reft_model, 0.0) for parameter in group["params"]]
    states = torch.load(checkpoint / "interventions.pt", weights_only=True)
    for state in states.values():
        state["state"] = {name: tensor.bfloat16() if name.startswith("learned_source.") else tensor
                          for name, tensor in state["state"].items()}
    rewrite(checkpoint, "interventions.pt", tensor_bytes(states))
    trainer = torch.load(checkpoint / "trainer_state.pt", weights_only=True)
    for index, state in trainer["optimizer"]["state"].items():
        if ".learned_source." in order[index]:
            state.update({key: state[key].bfloat16() for key in ("exp_avg", "exp_avg_sq")})
    rewrite(checkpoint, "trainer_state.pt", tensor_bytes(trainer))
    for path in checkpoint.glob("intkey_*.bin"):  # the pyreft-format copy: learned source `weight`, `bias`
        saved = torch.load(path, weights_only=True)
        rewrite(checkpoint, path.name, tensor_bytes({name: tensor.bfloat16() if name in ("weight", "bias") else tensor
                                                     for name, tensor in saved.items()}))
    assert is_complete(checkpoint)

    status, stdout, stderr = run_in_process("train.py", [*flags(tiny_model, tiny_data, old, *SINGLE, "--dtype",
                                                                "bfloat16"), "--resume_from_checkpoint", "auto"])
    assert status == 0, stderr[-3000:]
    assert "at step 4" in stdout
    resumed, uninterrupted = intervention_weights(old), intervention_weights(run)
    at_checkpoint = intervention_weights(checkpoint)
    for key, expected in uninterrupted.items():
        if expected.is_floating_point():
            assert resumed[key].dtype == torch.float32, key
            deviation = ((resumed[key] - expected).norm() / expected.norm()).item()
            moved = ((expected - at_checkpoint[key].float()).norm() / expected.norm()).item()
            assert deviation <= 0.1 * moved, (key, deviation, moved)
