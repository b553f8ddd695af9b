"""The logging window (alpaca.output.LogWindow): named sums, all-reduced as one tensor, kept in a checkpoint and
carried over a resume by name."""

import json

import pytest
import torch

from alpaca.errors import UsageError
from alpaca.output import LogWindow, train_record

DEVICE = torch.device("cpu")


def micro_batch(loss: float, label_tokens: int, tokens: int) -> tuple[torch.Tensor, dict]:
    """A micro-batch's summed token loss (float32, as the loss computes it) and its collator's counts."""
    return torch.tensor(loss, dtype=torch.float32), {"num_label_tokens": label_tokens, "num_tokens": tokens}


BATCHES = [micro_batch(12.5, 5, 20), micro_batch(7.25, 3, 16), micro_batch(0.1, 1, 9)]


def test_the_sums_are_named_and_the_collators_counts_stay_on_the_host():
    """The loss stays a tensor until a logging step reads it; label tokens and tokens stay Python ints (reading
    them needs no wait for the device), and travel in the totals in SUMS order."""
    window = LogWindow(DEVICE)
    for summed_loss, batch in BATCHES:
        window.add(summed_loss, batch)
    assert isinstance(window.sums["loss_sum"], torch.Tensor) and window.sums["loss_sum"].dtype == torch.float64
    assert window.sums["label_tokens"] == 9 and type(window.sums["label_tokens"]) is int
    assert window.sums["tokens"] == 45 and type(window.sums["tokens"]) is int
    totals = window.totals()
    assert totals.dtype == torch.float64 and totals.shape == (len(LogWindow.SUMS),)
    expected_loss = sum(loss.double() for loss, _ in BATCHES).item()  # the float32 losses, summed in float64
    assert LogWindow.named(totals) == {"loss_sum": expected_loss, "label_tokens": 9.0, "tokens": 45.0}
    record = train_record(4, 2, LogWindow.named(totals), learning_rate=1e-3, grad_norm=0.5, window_seconds=3.0,
                          elapsed_s=10.0)
    assert record["loss"] == expected_loss / 9 and record["tokens_per_s"] == 15.0 and record["epoch"] == 2.0
    window.reset()
    assert LogWindow.named(window.totals()) == dict.fromkeys(LogWindow.SUMS, 0.0)
    assert window.tokens_seen == 45  # the process's throughput is not reset with the window


def test_a_metric_of_ones_own_is_one_name_and_its_all_reduced_totals_read_back_by_name(monkeypatch):
    """Two ranks' windows, summed element-wise as all_reduce sums them, read back by name: each sum is the sum
    of the ranks' sums, also for a sum added only on one rank (a device value there, nothing on the other),
    whichever position its name has in SUMS."""
    monkeypatch.setattr(LogWindow, "SUMS", ("weight_norm_squared", *LogWindow.SUMS))
    ranks = [LogWindow(DEVICE), LogWindow(DEVICE)]
    for rank, (summed_loss, batch) in zip([0, 1, 1], BATCHES, strict=True):
        ranks[rank].add(summed_loss, batch)
    ranks[0].add_sums(weight_norm_squared=torch.tensor(2.5, dtype=torch.float32))
    reduced = ranks[0].totals() + ranks[1].totals()
    named = LogWindow.named(reduced)
    assert list(named) == ["weight_norm_squared", "loss_sum", "label_tokens", "tokens"]
    assert named["weight_norm_squared"] == 2.5 and named["label_tokens"] == 9 and named["tokens"] == 45
    assert named["loss_sum"] == (torch.tensor(12.5).double() + (torch.tensor(7.25).double()
                                                                 + torch.tensor(0.1).double())).item()
    with pytest.raises(KeyError):  # a name not in SUMS is an error, not a sum nobody logs
        ranks[0].add_sums(weight_norm=1.0)


def test_a_checkpoint_keeps_the_window_by_name_and_a_resume_carries_only_the_carried_sums():
    """The window saved mid-way (as trainer_state.json holds it) and restored: the loss and label tokens carry
    on, so the next log is bit-identical to the uninterrupted window's; the tokens restart with the clock."""
    uninterrupted = LogWindow(DEVICE)
    for summed_loss, batch in BATCHES:
        uninterrupted.add(summed_loss, batch)
    before = LogWindow(DEVICE)
    before.add(*BATCHES[0])
    saved = json.loads(json.dumps({"window": LogWindow.named(before.totals())}))["window"]
    assert saved.keys() == set(LogWindow.SUMS)
    carried = LogWindow.restored(saved)
    assert carried == {name: saved[name] for name in LogWindow.CARRIED} and "tokens" not in carried
    resumed = LogWindow(DEVICE, carried)
    for summed_loss, batch in BATCHES[1:]:
        resumed.add(summed_loss, batch)
    expected = LogWindow.named(uninterrupted.totals())
    assert LogWindow.named(resumed.totals()) == {**expected, "tokens": expected["tokens"] - BATCHES[0][1]["num_tokens"]}


@pytest.mark.parametrize("saved", [[12.5, 5.0, 20.0], {"loss_sum": 12.5, "tokens": 20.0}])
def test_a_window_without_the_carried_names_is_refused_in_one_line(saved):
    """A checkpoint written when the window was a list (or without a sum this version carries) cannot be carried
    on by name."""
    with pytest.raises(UsageError, match=r"^the checkpoint's logging window lacks the sums this version carries "
                                         r"over a resume \(loss_sum, label_tokens\): .* in another --output_dir$"):
        LogWindow.restored(saved)
