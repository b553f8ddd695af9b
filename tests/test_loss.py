"""The step objective and the no-op padding position, checked on gradients of a tiny ReFT model.

In float64, so that "equal up to summation order" can be asserted tightly."""

import pytest
import torch
from conftest import FLOAT64_ATOL, FLOAT64_RTOL, assert_within_rounding

from alpaca.collate import Collator, intervention_locations
from alpaca.data import load_records, tokenize
from alpaca.loss import summed_token_loss, token_losses, token_weighted_loss
from alpaca.model import build_reft_model, intervention_parameters, load_base_model, set_attention

POSITION = (2, 2)


def reft_setup(tiny_model, tiny_data, attention: str = "sdpa"):
    model, tokenizer = load_base_model(str(tiny_model), torch.float64, torch.device("cpu"))
    set_attention(model, attention)
    dataset = tokenize(load_records(str(tiny_data)), tokenizer, 512)
    torch.manual_seed(0)
    reft_model = build_reft_model(model, "1;2", POSITION, False, low_rank_dimension=4)
    # Random learned sources, so the interventions are far from the identity and the test is sharp.
    # (The rotation keeps its random orthogonal init: its raw parameter is not free, see optimizer_param_groups.)
    for intervention in reft_model.interventions.values():
        torch.nn.init.normal_(intervention.learned_source.weight, std=0.3)
    collate = Collator(tokenizer.pad_token_id, POSITION, False, num_layers=2)
    return reft_model, dataset, collate


@pytest.fixture(scope="module")
def setup(tiny_model, tiny_data):
    return reft_setup(tiny_model, tiny_data)


def gradients(reft_model, micro_batches, scale):
    parameters = [p for _, p in intervention_parameters(reft_model)]
    for parameter in parameters:
        parameter.grad = None
    for batch in micro_batches:
        scale(summed_token_loss(reft_model, batch, torch.device("cpu")), batch).backward()
    return [p.grad.clone() for p in parameters]


@pytest.mark.fast
def test_token_weighted_accumulation_equals_one_big_batch(setup):
    reft_model, dataset, collate = setup
    examples = [dataset[i] for i in range(6)]
    whole = collate(examples)
    micro = [collate(examples[:1]), collate(examples[1:4]), collate(examples[4:])]
    total = sum(b["num_label_tokens"] for b in micro)
    assert total == whole["num_label_tokens"]
    reference = gradients(reft_model, [whole], lambda loss, batch: token_weighted_loss(loss, total))
    accumulated = gradients(reft_model, micro, lambda loss, batch: token_weighted_loss(loss, total))
    for expected, actual in zip(reference, accumulated):
        torch.testing.assert_close(actual, expected, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    # What the HF Trainer does (mean of micro-batch means) is a different objective.
    mean_of_means = gradients(reft_model, micro,
                              lambda loss, batch: loss / batch["num_label_tokens"] / len(micro))
    assert not all(torch.allclose(a, b, rtol=1e-3) for a, b in zip(reference, mean_of_means))


@pytest.mark.fast
def test_data_parallel_scaling_matches_one_process(setup):
    """Two 'ranks' each scaling by world_size / global tokens, then averaged as DDP does."""
    reft_model, dataset, collate = setup
    examples = [dataset[i] for i in range(5)]
    shards = [collate(examples[:3]), collate(examples[3:])]
    total = sum(b["num_label_tokens"] for b in shards)
    reference = gradients(reft_model, [collate(examples)], lambda loss, batch: token_weighted_loss(loss, total))
    per_rank = [gradients(reft_model, [shard], lambda loss, batch: token_weighted_loss(loss, total, world_size=2))
                for shard in shards]
    for expected, rank0, rank1 in zip(reference, *per_rank):
        torch.testing.assert_close((rank0 + rank1) / 2, expected, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)


@pytest.mark.fast
def test_padding_position_is_a_noop(setup):
    """A prompt too short for its intervened positions: the padded interventions change neither loss nor gradient."""
    reft_model, dataset, collate = setup
    example = dict(dataset[0])
    example["prompt_length"] = 3  # f2+l2 does not fit: the first positions are padded
    padded = collate([example])
    assert padded["intervention_locations"][0][0][1] == len(example["input_ids"]) - 1
    unpadded = dict(padded)
    unpadded["intervention_locations"] = intervention_locations([3], POSITION, False, 2, pad_position=None)
    for key in ("input_ids", "labels"):
        assert torch.equal(padded[key], unpadded[key])
    scale = lambda loss, batch: loss  # noqa: E731
    for expected, actual in zip(gradients(reft_model, [unpadded], scale), gradients(reft_model, [padded], scale)):
        torch.testing.assert_close(actual, expected, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    with torch.no_grad():
        assert summed_token_loss(reft_model, padded, torch.device("cpu")).item() == pytest.approx(
            summed_token_loss(reft_model, unpadded, torch.device("cpu")).item(), rel=FLOAT64_RTOL)


def test_logits_only_where_labels_exist_give_the_full_loss(setup):
    """`logits_to_keep` skips the prompt prefix: same loss as projecting every position."""
    reft_model, dataset, collate = setup
    batch = collate([dataset[i] for i in range(4)])
    full = dict(batch, first_label_position=1, num_kept_logits=batch["input_ids"].shape[1])  # every position's logits
    with torch.no_grad():
        assert summed_token_loss(reft_model, batch, torch.device("cpu")).item() == pytest.approx(
            summed_token_loss(reft_model, full, torch.device("cpu")).item(), rel=FLOAT64_RTOL)


def test_edited_labels_are_all_in_the_loss(setup):
    """A copy of the collator that labels other tokens (here the last 3 prompt tokens too): the loss counts
    exactly the labels it marks, none cut away by `logits_to_keep`."""
    reft_model, dataset, collate = setup

    class EditedCollator(Collator):
        def example_labels(self, example, ids):
            labels = ids.clone()
            labels[: example["prompt_length"] - 3] = -100
            return labels

    edited = EditedCollator(collate.pad_token_id, POSITION, False, num_layers=2)
    examples = [dataset[i] for i in range(4)]
    batch = edited(examples)
    assert batch["first_label_position"] == min(example["prompt_length"] for example in examples) - 3
    with torch.no_grad():
        losses = token_losses(reft_model, batch, torch.device("cpu"))
        every_position = dict(batch, first_label_position=1, num_kept_logits=batch["input_ids"].shape[1])
        full = token_losses(reft_model, every_position, torch.device("cpu"))
    assert int((losses != 0).sum()) == batch["num_label_tokens"] > collate(examples)["num_label_tokens"]
    assert losses.sum().item() == pytest.approx(full.sum().item(), rel=FLOAT64_RTOL)


def test_rounded_padding_changes_neither_loss_nor_gradients(setup):
    """--pad_to_multiple_of: up to 31 more padded columns per row, the same step."""
    reft_model, dataset, collate = setup
    examples = [dataset[i] for i in range(5)]
    rounded = Collator(collate.pad_token_id, POSITION, False, num_layers=2, pad_to_multiple_of=32)
    plain_batch, rounded_batch = collate(examples), rounded(examples)
    assert rounded_batch["input_ids"].shape[1] > plain_batch["input_ids"].shape[1]
    scale = lambda loss, batch: token_weighted_loss(loss, batch["num_label_tokens"])  # noqa: E731
    for expected, actual in zip(gradients(reft_model, [plain_batch], scale),
                                gradients(reft_model, [rounded_batch], scale)):
        torch.testing.assert_close(actual, expected, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    with torch.no_grad():
        assert summed_token_loss(reft_model, rounded_batch, torch.device("cpu")).item() == pytest.approx(
            summed_token_loss(reft_model, plain_batch, torch.device("cpu")).item(), rel=FLOAT64_RTOL)


@pytest.mark.fast
def test_right_padding_needs_no_attention_mask(tiny_model, tiny_data):
    """In float32, as trained: without the mask every label's loss and every gradient are those with it (within
    float32 rounding: the softmax sums over other key counts), on a right-padded batch of very different
    lengths; the rounding error is measured against the masked run in float64."""
    results = {}
    for dtype, attention_mask in ((torch.float32, True), (torch.float32, False), (torch.float64, True)):
        model, tokenizer = load_base_model(str(tiny_model), dtype, torch.device("cpu"))
        dataset = tokenize(load_records(str(tiny_data)), tokenizer, 512)
        torch.manual_seed(0)
        reft_model = build_reft_model(model, "1;3", POSITION, False, low_rank_dimension=4)
        for intervention in reft_model.interventions.values():
            torch.nn.init.normal_(intervention.learned_source.weight, std=0.3)
        order = sorted(range(len(dataset)), key=lambda i: len(dataset[i]["input_ids"]))
        batch = Collator(tokenizer.pad_token_id, POSITION, False, num_layers=2, pad_to_multiple_of=16)(
            [dataset[i] for i in order[:: len(order) // 5]])  # shortest to longest
        assert (batch["attention_mask"][:-1] == 0).any(dim=1).all()  # every row but the longest is padded
        parameters = [p for _, p in intervention_parameters(reft_model)]
        losses = token_losses(reft_model, batch, torch.device("cpu"), attention_mask=attention_mask)
        (losses.sum() / batch["num_label_tokens"]).backward()
        results[dtype, attention_mask] = [losses.detach(), *(p.grad for p in parameters)]
    labelled = batch["labels"][:, batch["first_label_position"]:] != -100
    masked, unmasked, truth = results.values()
    assert int(labelled.sum()) == batch["num_label_tokens"] and (masked[0][~labelled] == 0).all()
    assert_within_rounding([unmasked[0][labelled], *unmasked[1:]], [masked[0][labelled], *masked[1:]],
                           [truth[0][labelled], *truth[1:]])


@pytest.mark.fast
def test_scatter_on_device_is_pyvenes_write(setup):
    """The intervened positions written back with the batch index on the activation's device (no host-to-device
    copy per hook on CUDA) give pyvene's own losses and gradients exactly."""
    reft_model, dataset, collate = setup
    batch = collate([dataset[i] for i in range(5)])
    ours = gradients(reft_model, [batch], lambda loss, _: loss)
    ours_loss = summed_token_loss(reft_model, batch, torch.device("cpu"))
    scatter = reft_model._scatter_intervention_output
    del reft_model._scatter_intervention_output  # back to pyvene's method
    try:
        pyvenes = gradients(reft_model, [batch], lambda loss, _: loss)
        pyvenes_loss = summed_token_loss(reft_model, batch, torch.device("cpu"))
    finally:
        reft_model._scatter_intervention_output = scatter
    assert torch.equal(ours_loss, pyvenes_loss)
    for expected, actual in zip(pyvenes, ours):
        assert torch.equal(actual, expected)


def test_a_penalty_over_the_intervened_positions_needs_their_mask(setup):
    """A loss term over the intervened positions (here the squared norm of the last intervened layer's output
    there), summed per micro-batch on two 'ranks' as DDP sums gradients: under `intervention_mask` the same
    gradient as one process's whole batch; summed over the padded positions too, another one (how many there
    are, and where, depends on how the step is cut)."""
    reft_model, dataset, collate = setup
    examples = [dict(dataset[i]) for i in range(4)]
    examples[1]["prompt_length"] = examples[3]["prompt_length"] = 3  # f2+l2 does not fit: padded
    whole, shards = collate(examples), [collate(examples[:2]), collate(examples[2:])]
    assert not all(mask.all() for mask in whole["intervention_mask"])
    assert whole["num_intervened_positions"] == sum(shard["num_intervened_positions"] for shard in shards)

    def penalty(batch, masked):
        locations = batch["intervention_locations"]
        _, outputs = reft_model({"input_ids": batch["input_ids"], "output_hidden_states": True, "use_cache": False},
                                unit_locations={"sources->base": (None, locations)})
        hidden = outputs.hidden_states[3]  # the output of layer 2, the last intervened one
        rows = torch.arange(hidden.shape[0])[:, None]
        return sum((hidden[rows, positions].pow(2).sum(-1) * (mask if masked else 1)).sum()
                   for positions, mask in zip(locations, batch["intervention_mask"]))

    parameters = [p for _, p in intervention_parameters(reft_model)]
    for masked in (True, False):
        one_process = torch.autograd.grad(penalty(whole, masked), parameters)
        two_ranks = [sum(grads) for grads in zip(*(torch.autograd.grad(penalty(shard, masked), parameters)
                                                   for shard in shards))]
        deviation = max(((a - b).norm() / b.norm()).item() for a, b in zip(two_ranks, one_process))
        assert deviation < FLOAT64_RTOL if masked else deviation > 1e-3, (masked, deviation)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_pack_is_the_padded_batch(setup, attention):
    """--packing: examples end to end in one row, positions restarting at each, give every example's loss and
    the gradients of the padded batch (float64, to summation order), with transformers' SDPA and eager
    attention; also with a prompt too short for its intervened positions (padded ones) and the tail rounded up."""
    reft_model = setup[0]
    implementation = reft_model.model.config._attn_implementation
    reft_model.model.set_attn_implementation(attention)
    try:
        assert_pack_is_the_padded_batch(*setup)
    finally:
        reft_model.model.set_attn_implementation(implementation)


@pytest.mark.parametrize("takes_grouped_heads", [True, False], ids=["torch-2.13", "torch-2.11"])
def test_varlen_attention_gives_a_pack_the_padded_batch(tiny_model, tiny_data, monkeypatch, takes_grouped_heads):
    """--attn_implementation sdpa_varlen: a pack's attention goes through torch's varlen kernel with the pack's
    boundaries, query, key and value laid out as it takes them (tokens x heads x head dim, the tiny model's 2
    key-value heads for 4 query heads, or, to torch 2.11's kernel, which takes no `enable_gqa`, each repeated for
    its 2 query heads), and gives the padded batch's losses and gradients, with no mask built and no
    packed-sequence check (its host sync). The kernel runs on CUDA only: here each example's causal SDPA stands in
    for it, so what is tested is everything around it."""
    import torch.nn.functional as F
    import transformers.masking_utils
    from torch.nn.attention import varlen

    from alpaca import workarounds
    from alpaca.constants import VARLEN_ATTENTION

    calls = []

    def each_example_causal(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size,
                            **grouped):
        bounds = cu_seq_q.tolist()
        assert torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k == max(b - a for a, b in zip(bounds, bounds[1:]))
        heads_per_key = 2 if takes_grouped_heads else 1
        assert window_size == (-1, 0) and query.shape[1] == heads_per_key * key.shape[1]
        assert grouped == ({"enable_gqa": True} if takes_grouped_heads else {})
        # what the CUDA kernel takes: int32 boundaries on the tensors' device, Python ints, a contiguous last dim
        assert cu_seq_q.dtype == torch.int32 and cu_seq_q.is_contiguous() and cu_seq_q.device == query.device
        assert type(max_q) is int and all(t.stride(-1) == 1 for t in (query, key, value))
        calls.append(len(bounds) - 1)
        return torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (query, key, value)),
                                                         is_causal=True, scale=scale, enable_gqa=True).transpose(0, 1)
                          for a, b in zip(bounds, bounds[1:])])

    checks = []
    monkeypatch.setattr(varlen, "varlen_attn", each_example_causal)
    monkeypatch.setattr(workarounds, "VARLEN_TAKES_GROUPED_HEADS", takes_grouped_heads)
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices", checks.append)
    reft_model, dataset, collate = reft_setup(tiny_model, tiny_data, VARLEN_ATTENTION)
    pack = Collator(collate.pad_token_id, POSITION, False, num_layers=2).pack([dataset[i] for i in range(3)])
    with torch.no_grad():
        token_losses(reft_model, pack, torch.device("cpu"))
    assert calls == [3] * 4 and checks == []  # 4 layers, 3 examples each; sdpa would have checked once
    calls.clear()
    assert_pack_is_the_padded_batch(reft_model, dataset, collate)
    assert calls and set(calls) == {6}  # 5 examples and the rounded tail, in each layer of each forward


@pytest.mark.parametrize("model_type, config, sliding", [("mistral", {"sliding_window": 8}, True),
                                                          ("gemma3_text", {}, True),  # its layer_types
                                                          ("qwen2", {"sliding_window": 8}, False),  # not used
                                                          ("llama", {}, False)])
def test_varlen_attention_refuses_sliding_windows(model_type, config, sliding):
    """sdpa_varlen runs full causal attention: a model with a sliding-window layer is refused in one line."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from alpaca.constants import VARLEN_ATTENTION
    from alpaca.errors import UsageError

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            model_type, num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=128, **config))
    if sliding:
        with pytest.raises(UsageError, match="the model has sliding-window attention"):
            set_attention(model, VARLEN_ATTENTION)
    else:
        set_attention(model, VARLEN_ATTENTION)
        assert model.config._attn_implementation == VARLEN_ATTENTION


def assert_pack_is_the_padded_batch(reft_model, dataset, collate) -> None:
    examples = [dict(dataset[i]) for i in range(5)]
    examples[2]["prompt_length"] = 3  # f2+l2 does not fit
    rounded = Collator(collate.pad_token_id, POSITION, False, num_layers=2, pad_to_multiple_of=16)
    padded, pack = collate(examples), rounded.pack(examples)
    assert pack["input_ids"].shape == (1, -(-sum(len(e["input_ids"]) for e in examples) // 16) * 16)
    for key in ("num_label_tokens", "num_intervened_positions", "num_tokens"):
        assert pack[key] == padded[key], key
    scale = lambda loss, batch: loss  # noqa: E731
    for expected, actual in zip(gradients(reft_model, [padded], scale), gradients(reft_model, [pack], scale)):
        torch.testing.assert_close(actual, expected, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    with torch.no_grad():
        padded_losses = token_losses(reft_model, padded, torch.device("cpu")).sum(dim=1)
        pack_losses = token_losses(reft_model, pack, torch.device("cpu"))[0]
    # Each example's losses sit in the pack from its start on (the pack's kept logits start at its first label).
    starts = torch.tensor([0] + [len(e["input_ids"]) for e in examples]).cumsum(0) - pack["first_label_position"]
    per_example = torch.stack([pack_losses[max(start, 0) : max(end, 0)].sum() for start, end in
                               zip(starts[:-1].tolist(), starts[1:].tolist())])
    torch.testing.assert_close(per_example, padded_losses, rtol=FLOAT64_RTOL, atol=0)


def test_attention_without_mask_checks_gives_sdpas_hidden_states(setup, monkeypatch):
    """A forward with no mask and no cache (the training step's) runs our registered SDPA function: transformers
    prepares no mask and never looks for packed sequences (its host sync), and every layer's output is sdpa's
    bit for bit. A forward with a mask goes through "sdpa" again."""
    import transformers.masking_utils

    reft_model, dataset, collate = setup
    model = reft_model.model
    checks = []
    find_packed = transformers.masking_utils.find_packed_sequence_indices
    monkeypatch.setattr(transformers.masking_utils, "find_packed_sequence_indices",
                        lambda position_ids: checks.append(1) or find_packed(position_ids))
    input_ids = collate([dataset[i] for i in range(3)])["input_ids"]
    with torch.no_grad():
        ours = model(input_ids=input_ids, use_cache=False, output_hidden_states=True).hidden_states
        assert checks == [] and model.config._attn_implementation == "sdpa_causal_no_mask"
        summed_token_loss(reft_model, collate([dataset[i] for i in range(3)]), torch.device("cpu"))
        assert checks == []
        model.config._attn_implementation = "sdpa"
        sdpas = model.model(input_ids=input_ids, use_cache=False, output_hidden_states=True).hidden_states  # no hook
        assert checks == [1]
        model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False)
        assert model.config._attn_implementation == "sdpa"
    assert len(ours) == len(sdpas) and all(torch.equal(a, b) for a, b in zip(ours, sdpas))


def test_kept_logits_take_the_widths_shapes(setup):
    """--pad_to_multiple_of N: the kept logits are a multiple of N (or the whole width) whatever the first label."""
    reft_model, dataset, collate = setup
    rounded = Collator(collate.pad_token_id, POSITION, False, num_layers=2, pad_to_multiple_of=16)
    for start in range(0, 12, 3):
        batch = rounded([dataset[i] for i in range(start, start + 3)])
        width, kept = batch["input_ids"].shape[1], batch["num_kept_logits"]
        assert width - batch["first_label_position"] + 1 <= kept and (kept % 16 == 0 or kept == width)
