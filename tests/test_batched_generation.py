"""Batched generation is exact: left-padded batches answer as each prompt alone (alpaca.generation.generate_batch).

In the Makefile's EQUIVALENCE list: a batch and a prompt alone run kernels on other shapes, so their float32
logits differ in the last bits, and a greedy token could flip where two logits tie to rounding. The first step's
logits of every row are within the suite's derived bound of batch size 1 on any CPU; the tokens were identical
for these prompts on every CPU the suite has run on."""

import torch
from conftest import assert_within_rounding, mixed_records

from alpaca.data import format_prompt
from alpaca.generation import generate_batch, new_tokens
from alpaca.model import load_base_model
from alpaca.output import load_reft_model

POSITION, LAYERS = (2, 2), 2  # the `runs` recipe's f2+l2 on 2 layers


def test_a_left_padded_batch_answers_as_each_prompt_alone(runs, tiny_tied_model):
    """Prompts of 2 to about 600 tokens in one batch: two too short for the f2+l2 positions (whose missing
    positions fall on padding), the others' first positions right at the padding's edge. Each row's greedy
    tokens are its batch-size-1 tokens, and its first-step logits within rounding of them."""
    root, _ = runs
    models = {}
    for dtype in (torch.float32, torch.float64):
        model, tokenizer = load_base_model(str(tiny_tied_model), dtype, torch.device("cpu"))
        models[dtype] = load_reft_model(root / "single", model)
    records = mixed_records()[21:25]
    prompts = [tokenizer(format_prompt(r["instruction"], r["input"]))["input_ids"] for r in records]
    prompts += [prompts[0][:2], prompts[1][:3], tokenizer(format_prompt("Say it again. " * 60))["input_ids"]]
    assert min(map(len, prompts)) == 2 and max(map(len, prompts)) > 500

    def generated(dtype, rows):
        return generate_batch(models[dtype], rows, tokenizer.pad_token_id, POSITION, False, LAYERS, max_new_tokens=8,
                              do_sample=False, eos_token_id=tokenizer.eos_token_id, output_logits=True)

    batched = generated(torch.float32, prompts)
    for row, prompt in enumerate(prompts):
        alone, truth = generated(torch.float32, [prompt]), generated(torch.float64, [prompt])
        (tokens, cut), (alone_tokens, alone_cut) = (new_tokens(sequences, tokenizer.eos_token_id)
                                                    for sequences in (batched.sequences[row], alone.sequences[0]))
        assert torch.equal(tokens, alone_tokens) and cut == alone_cut, row
        assert_within_rounding([batched.logits[0][row]], [alone.logits[0][0]], [truth.logits[0][0]])
    # the interventions act: without them the first row answers otherwise
    plain = generate_batch(models[torch.float32], prompts[:1], tokenizer.pad_token_id, POSITION, False, LAYERS,
                           intervene=False, max_new_tokens=8, do_sample=False, eos_token_id=tokenizer.eos_token_id)
    assert not torch.equal(plain.sequences[0], batched.sequences[0])
