"""Answers of the base model and of a ReFT model: in left-padded batches with each row's interventions where
training puts them, a side-by-side view of them, and what can be said of a file of answers without a judge."""

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


def prompt_ids(tokenizer, instructions: list, inputs: list[str], prompt_template: str,
               model_max_length: int | None = None) -> tuple[list[list[int]], list[int]]:
    """Return the token ids of each prompt rendered and encoded as in training (an instruction, or a conversation whose
    last message is the user's), cut to its first `model_max_length` tokens as training cuts an example; and
    the indices of the prompts cut."""
    texts = [render_prompt(tokenizer, instruction, input, prompt_template)
             for instruction, input in zip(instructions, inputs)]
    ids = encode_prompts(tokenizer, texts, prompt_template)["input_ids"]
    cut = [index for index, row in enumerate(ids) if model_max_length is not None and len(row) > model_max_length]
    return [row[:model_max_length] if model_max_length else row for row in ids], cut


@torch.no_grad()
def generate_batch(reft_model, prompts: list[list[int]], pad_token_id: int, position: tuple[int, int],
                   share_weights: bool, num_layers: int, intervene: bool = True, device: torch.device | None = None,
                   **settings):
    """Return transformers' generate output (`settings`: its arguments) for prompts left-padded into one batch; its
    `sequences` hold the new tokens only. With `intervene` the interventions act on each prompt's forward, at
    the positions training uses for that prompt, moved right by the row's padding (never found by a token
    search, which a pad id equal to BOS breaks); later tokens come from the KV cache, as in pyvene's generate.

    A row whose prompt is too short for every intervened position fills the missing ones with column 0: one
    column more is padded so that column 0 is padding in every row, which no real token attends to.

    The batch is built on `device`, by default where the base's input embeddings run. Training passes its own device:
    a base offloaded to the CPU (--fsdp offload) keeps its embeddings there, and with `synced_gpus` transformers
    all-reduces a flag made on the inputs' device, which NCCL refuses unless it is the rank's GPU."""
    first_n, last_n = position
    lengths = [len(row) for row in prompts]
    short = len(prompts) > 1 and min(lengths) < first_n + last_n
    width = max(lengths) + short
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, width - len(ids) :] = 1
    device = device or input_device(reft_model.model)
    batch = {"input_ids": input_ids.to(device), "attention_mask": attention_mask.to(device)}
    settings = dict(pad_token_id=pad_token_id, return_dict_in_generate=True, **settings)
    set_train_mode(reft_model, False)
    if intervene:
        locations = intervention_locations(lengths, position, share_weights, num_layers,
                                           pad_position=0 if short else None,
                                           offsets=[width - length for length in lengths])
        _, output = reft_model.generate(batch, unit_locations={"sources->base": (None, locations)},
                                        intervene_on_prompt=True, **settings)
    else:
        output = reft_model.model.generate(**batch, **settings)
    output.sequences = output.sequences[:, width:]
    return output


def new_tokens(row: torch.Tensor, eos_token_id: int) -> tuple[torch.Tensor, bool]:
    """Return a row of generated tokens up to its first eos, and whether it has none (cut at --max_new_tokens)."""
    eos = (row == eos_token_id).nonzero()
    return (row[: int(eos[0])], False) if len(eos) else (row, True)


def decode_answers(tokenizer, sequences: torch.Tensor) -> list[tuple[str, int, bool]]:
    """Decode each generated row: (answer text, its tokens, whether it was cut at --max_new_tokens)."""
    rows = [new_tokens(row.cpu(), tokenizer.eos_token_id) for row in sequences]
    return [(tokenizer.decode(tokens, skip_special_tokens=True).strip(), len(tokens), cut) for tokens, cut in rows]


def answer(reft_model, tokenizer, instruction: str | list[dict[str, str]], position: tuple[int, int],
           share_weights: bool, num_layers: int, max_new_tokens: int = 96, input: str = "",
           prompt_template: str = "alpaca", synced_ranks: bool = False,
           device: torch.device | None = None) -> tuple[str, str]:
    """Generate (base answer, ReFT answer) to an instruction, or to a conversation (its messages, the last the user's)
    under the chat template, greedy. A sharded base (FSDP, ZeRO-3) gathers its weights in every forward: with
    `synced_ranks` a rank that meets EOS first keeps running forwards until all have, instead of leaving the
    others waiting in a gather. `device`: where the prompt is built (generate_batch)."""
    prompts, _ = prompt_ids(tokenizer, [instruction], [input], prompt_template)
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                    synced_gpus=synced_ranks, device=device)
    base, reft = (decode_answers(tokenizer, generate_batch(reft_model, prompts, tokenizer.pad_token_id, position,
                                                           share_weights, num_layers, intervene,
                                                           **settings).sequences)[0][0]
                  for intervene in (False, True))
    return base, reft


def summary(answers: list[tuple[str, int, bool]]) -> dict:
    """Summarize what can be said of answers without a judge: how many, their mean length in characters and tokens, how
    many are empty and how many were cut at --max_new_tokens."""
    count = len(answers)
    return {"answers": count,
            "mean_characters": sum(len(text) for text, _, _ in answers) / max(count, 1),
            "mean_tokens": sum(tokens for _, tokens, _ in answers) / max(count, 1),
            "empty": sum(not text for text, _, _ in answers),
            "cut_at_max_new_tokens": sum(cut for _, _, cut in answers)}


def sample_answers(reft_model, tokenizer, args, position: tuple[int, int], num_layers: int, device: torch.device,
                   synced_ranks: bool = False) -> str:
    """Build the end-of-run view: --num_sample_answers held-out instructions, base vs ReFT, their prompts built on the
    training `device`. `synced_ranks`: every rank generates (a sharded base), in step."""
    rows = [(instruction, *answer(reft_model, tokenizer, instruction, position, args.share_weights, num_layers,
                                  args.max_new_tokens, prompt_template=args.prompt_template,
                                  synced_ranks=synced_ranks, device=device))
            for instruction in SAMPLE_INSTRUCTIONS[: args.num_sample_answers]]
    return side_by_side(rows)


def _wrap(text: str, width: int) -> list[str]:
    """Wrap each line on its own, so lists and paragraphs keep their shape."""
    return [piece for line in (text or "(empty)").splitlines() for piece in (textwrap.wrap(line, width) or [""])]


def side_by_side(rows: list[tuple[str, str, str]], width: int | None = None,
                 headers: tuple[str, str] = ("BASE MODEL", "REFT MODEL")) -> str:
    """Lay out each instruction, then two answers (by default base and ReFT) in two columns."""
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
