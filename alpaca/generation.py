"""Greedy answers of the base model and of the ReFT model, and a side-by-side view of them."""

from __future__ import annotations

import shutil
import textwrap

import torch

from alpaca.collate import intervention_locations
from alpaca.data import encode_prompts, render_prompt
from alpaca.device_map import input_device
from alpaca.workarounds import set_train_mode

# Held out from the shipped training data: they show whether the learned behaviour generalizes.
SAMPLE_INSTRUCTIONS = [
    "Name three primary colors.",
    "What causes the seasons on Earth?",
    "Give two tips for staying focused while studying.",
]


@torch.no_grad()
def answer(reft_model, tokenizer, instruction: str | list[dict[str, str]], position: tuple[int, int],
           share_weights: bool, num_layers: int, max_new_tokens: int = 96, input: str = "",
           prompt_template: str = "alpaca", synced_ranks: bool = False) -> tuple[str, str]:
    """(base answer, ReFT answer) to an instruction, or to a conversation (its messages, the last the user's)
    under the chat template. The prompt is rendered as in training (`prompt_template`), and the interventions
    act on its positions only."""
    device = input_device(reft_model.model)
    text = render_prompt(tokenizer, instruction, input, prompt_template)
    prompt = encode_prompts(tokenizer, [text], prompt_template, return_tensors="pt").to(device)
    prompt_length = prompt["input_ids"].shape[1]
    # A sharded base (FSDP, ZeRO-3) gathers its weights in every forward: with `synced_ranks` a rank that meets
    # EOS first keeps running forwards until all have, instead of leaving the others waiting in a gather.
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                    pad_token_id=tokenizer.pad_token_id, synced_gpus=synced_ranks)
    set_train_mode(reft_model, False)
    base_ids = reft_model.model.generate(**prompt, **settings)
    locations = intervention_locations([prompt_length], position, share_weights, num_layers, pad_position=None)
    _, reft_ids = reft_model.generate(
        dict(prompt), unit_locations={"sources->base": (None, locations)}, intervene_on_prompt=True, **settings
    )
    decode = lambda ids: tokenizer.decode(ids[0, prompt_length:], skip_special_tokens=True).strip()  # noqa: E731
    return decode(base_ids), decode(reft_ids)


def sample_answers(reft_model, tokenizer, args, position: tuple[int, int], num_layers: int,
                   synced_ranks: bool = False) -> str:
    """The end-of-run view: --num_sample_answers held-out instructions, base vs ReFT. `synced_ranks`: every
    rank generates (a sharded base), in step."""
    rows = [(instruction, *answer(reft_model, tokenizer, instruction, position, args.share_weights, num_layers,
                                  args.max_new_tokens, prompt_template=args.prompt_template,
                                  synced_ranks=synced_ranks))
            for instruction in SAMPLE_INSTRUCTIONS[: args.num_sample_answers]]
    return side_by_side(rows)


def _wrap(text: str, width: int) -> list[str]:
    """Wrap each line on its own, so lists and paragraphs keep their shape."""
    return [piece for line in (text or "(empty)").splitlines() for piece in (textwrap.wrap(line, width) or [""])]


def side_by_side(rows: list[tuple[str, str, str]], width: int | None = None,
                 headers: tuple[str, str] = ("BASE MODEL", "REFT MODEL")) -> str:
    """Instruction, then two answers (by default base and ReFT) in two columns."""
    width = width or min(shutil.get_terminal_size((120, 20)).columns, 140)
    column = (width - 3) // 2
    lines = []
    for instruction, base, reft in rows:
        if isinstance(instruction, list):  # a conversation: its last message, after how many came before
            instruction = f"(after {len(instruction) - 1} messages) {instruction[-1]['content']}"
        lines += ["=" * width, textwrap.shorten(f"Instruction: {instruction}", width), "-" * width]
        lines.append(f"{headers[0][:column]:<{column}} | {headers[1]}")
        left, right = _wrap(base, column), _wrap(reft, column)
        for index in range(max(len(left), len(right))):
            lines.append(f"{(left[index] if index < len(left) else ''):<{column}} | "
                         f"{right[index] if index < len(right) else ''}")
    lines.append("=" * width)
    return "\n".join(lines)
