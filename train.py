"""Train LoReFT interventions on Alpaca instruction data, on one device.

    python train.py                      # SmolLM2-135M-Instruct on the shipped sample data (make train)
    python train.py --model_name_or_path meta-llama/Llama-3.2-1B --data_path alpaca_data.json \
        --layers "8;19" --rank 4 --position "f1+l1" --learning_rate 2e-5 ...

Several GPUs: `torchrun --nproc_per_node N train_multigpu.py` with the same flags trains the same model.
"""

import argparse
import os
import sys

from alpaca.args import exit_on_usage_error, parse_args, resolve_device_defaults

PROG = "train.py"

if __name__ == "__main__":  # --help and usage errors answer here, before the heavy imports below
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:  # every rank would train on all the data, and overwrite the others' output
        sys.exit(f"{PROG}: error: launched on {world_size} processes (WORLD_SIZE={world_size}); train.py trains on "
                 f"one device. Use: torchrun --nproc_per_node {world_size} train_multigpu.py <same flags>")
    ARGS = parse_args(PROG)

import resource
import time

import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from alpaca.checkpoint import TrainerState, load_checkpoint, prepare_output_dir, save_checkpoint, save_output
from alpaca.collate import Collator, StepCollator, give_step_counts, step_counts
from alpaca.data import load_splits, prepare_dataset
from alpaca.divergence import exit_if_diverged
from alpaca.errors import UsageError
from alpaca.flag_values import parse_position
from alpaca.generation import sample_answers
from alpaca.launch import StopSignal
from alpaca.loss import evaluate, summed_token_loss, token_weighted_loss
from alpaca.model import (
    build_reft_model,
    check_attention,
    check_model,
    compile_decoder_layers,
    describe,
    enable_gradient_checkpointing,
    num_intervened_layers,
    resolve_dtype,
    set_attention,
)
from alpaca.optim import StepSchedule, build_optimizer
from alpaca.output import LogWindow, MetricsLog, eval_record, save_args, start_line, train_record
from alpaca.resume import (
    check_finished,
    finished_record,
    geometry,
    restore_training_state,
    rng_state,
    training_fingerprint,
)
from alpaca.sampler import DistributedGlobalBatchSampler, eval_batches, loader_workers
from alpaca.strategy import choose_strategy


def main(args: argparse.Namespace) -> None:
    try:
        train_on_one_device(args)
    except UsageError as error:
        exit_on_usage_error(PROG, error)


def train_on_one_device(args) -> None:
    """The device: one, never nn.DataParallel (it copies pyvene's location lists whole to every GPU); with
    --device_map the base spreads over every visible GPU (and the CPU, disk), the batch entering on the first. The
    device decides the dtype, the attention check and the device defaults of flags."""
    started = time.perf_counter()
    gpus = []
    if torch.cuda.is_available():
        device = torch.device("cuda:0")
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        gpus = list(range(torch.cuda.device_count())) if args.device_map is not None else [0]
        if torch.cuda.device_count() > len(gpus):
            print(f"{torch.cuda.device_count()} GPUs visible; train.py uses cuda:0. To train on all of them: "
                  f"torchrun --nproc_per_node {torch.cuda.device_count()} train_multigpu.py <same flags>, or "
                  "--device_map auto for a model one GPU cannot hold")
    else:
        device = torch.device("cpu")
    resolve_device_defaults(args, device.type)
    dtype = resolve_dtype(args.dtype, device)
    check_attention(args.attn_implementation, device, dtype)
    train(args, device, dtype, gpus, started)


def train(args, device, dtype, gpus: list[int], started: float) -> None:
    """Data, model, the training loop and the output, on the device (or the devices of a --device_map)."""
    stop = StopSignal()
    position = parse_position(args.position)
    strategy = choose_strategy(args, device, dtype, gpus, distributed=False)  # on the device, or a --device_map
    resume_from, finished = prepare_output_dir(args)  # refuses to clobber an earlier run, before anything loads

    # -- data and model --------------------------------------------------------------------------------
    tokenizer, reft_model, dataset, eval_dataset, num_layers, collate, fingerprint = load_data_and_model(
        args, strategy, dtype, position)

    # -- optimization: global batch = per_device x 1 process x accumulation --------------------------------
    schedule = StepSchedule.from_args(args, len(dataset), world_size=1)
    if finished is not None:  # --resume_from_checkpoint auto where this run finished (a requeue): nothing to do
        print(check_finished(finished, args, 1, len(dataset), fingerprint, schedule.total_steps))
        return
    optimizer, scheduler = build_optimizer(reft_model, args, schedule)
    step, start_epoch, start_batch, carried_window, wandb_run_id, optimizer_state = 0, 0, 0, {}, None, None
    if resume_from is not None:
        loaded = load_checkpoint(resume_from)
        step, start_epoch, start_batch, carried_window, wandb_run_id = restore_training_state(
            loaded, args, reft_model, None, scheduler, 0, 1, len(dataset), gpus, fingerprint)
        optimizer_state = loaded[1]["optimizer"]  # the strategy loads it once the parameters are placed
    summary = describe(reft_model, len(dataset), strategy.placed if strategy.device_map else device)
    train_model = strategy.wrap(reft_model, optimizer, scheduler, optimizer_state)
    print(start_line(summary, schedule, args, eval_dataset and len(eval_dataset),
                     resume_from, step, time.perf_counter() - started))
    resolved = dict(world_size=1, global_batch_size=schedule.global_batch_size, total_steps=schedule.total_steps)
    save_args(args, args.output_dir, **resolved)
    metrics = MetricsLog(args.output_dir, args, resume_step=step, wandb_run_id=wandb_run_id, **resolved)
    window = LogWindow(device, carried_window)

    def checkpoint(epoch: int, next_batch: int):
        """The state after `step` optimizer steps; training goes on at (epoch, next_batch) of the global batch plan."""
        exit_if_diverged(strategy, PROG, args.output_dir, metrics)
        trainer_state = TrainerState(
            step=step, epoch=epoch, next_batch=next_batch, window=LogWindow.named(window.totals()),
            optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(), rng=[rng_state(gpus)],
            geometry=geometry(args, world_size=1), seed=args.seed, num_examples=len(dataset),
            prompt_template=args.prompt_template, wandb_run_id=metrics.wandb_run_id, fingerprint=fingerprint)
        return save_checkpoint(args.output_dir, step, reft_model, trainer_state, args.save_total_limit)

    # -- data: one DataLoader item per optimizer step, the global batch of a world of one --------------------
    lengths = np.array(dataset["length"])
    sampler = DistributedGlobalBatchSampler(
        len(dataset), args.per_device_train_batch_size, args.gradient_accumulation_steps, seed=args.seed,
        lengths=lengths if args.group_by_length else None,
        packing=(lengths, args.packing_max_tokens) if args.packing_max_tokens else None)
    # its micro-batches collated in workers (--dataloader_num_workers), ahead of the step
    loader = DataLoader(dataset, batch_sampler=sampler, pin_memory=device.type == "cuda",
                        collate_fn=StepCollator(collate, args.per_device_train_batch_size, args.packing_max_tokens),
                        **loader_workers(args.dataloader_num_workers))
    eval_order = eval_batches(np.array(eval_dataset["length"]), args.per_device_eval_batch_size) if eval_dataset else []

    # -- train --------------------------------------------------------------------------------------
    progress = tqdm(total=schedule.total_steps, initial=step, desc="training", dynamic_ncols=True)
    eval_time, epoch = 0.0, start_epoch
    train_start = window_start = time.perf_counter()
    while step < schedule.total_steps:
        sampler.set_epoch(epoch)  # a new order each epoch, as with DistributedSampler
        sampler.set_start(start_batch if epoch == start_epoch else 0)  # a resumed run goes on mid-epoch
        for index, micro_batches in enumerate(loader, start=sampler.start):
            end_of_epoch = index == len(sampler.global_batches) - 1
            counts = step_counts(micro_batches)
            give_step_counts(micro_batches, counts)
            step_label_tokens = counts[0]
            if stop.received:  # preempted: checkpoint the last finished step, then exit 128 + the signal number
                path = checkpoint(epoch, next_batch=index)
                metrics.close()
                print(f"{PROG}: stopped by {stop.name} after step {step}; checkpoint in {path}. "
                      f"Resume with --resume_from_checkpoint auto", file=sys.stderr)
                sys.exit(stop.exit_code)
            learning_rate = scheduler.get_last_lr()[0]
            for batch in micro_batches:
                summed_loss = summed_token_loss(train_model, batch, device)
                strategy.backward(token_weighted_loss(summed_loss, step_label_tokens))
                window.add(summed_loss, batch)
            grad_norm = strategy.step(step + 1)
            step += 1
            progress.update()
            if schedule.should_log(step):
                logged = LogWindow.named(window.totals())
                now = time.perf_counter()
                metrics.write(train_record(step, schedule.steps_per_epoch, logged, learning_rate,
                                           float(grad_norm), now - window_start, now - train_start), progress)
                # the host has read this step: where one was not finite, stop before anything is saved
                exit_if_diverged(strategy, PROG, args.output_dir, metrics)
                window.reset()
                window_start = time.perf_counter()
            if schedule.should_evaluate(step, end_of_epoch):
                eval_start = time.perf_counter()
                totals = evaluate(reft_model, eval_dataset, eval_order, collate, device)
                seconds = time.perf_counter() - eval_start
                metrics.write(eval_record(step, schedule.steps_per_epoch, totals.tolist(), len(eval_dataset), seconds),
                              progress)
                window_start += seconds  # tokens/s counts training time only
                eval_time += seconds
            if schedule.should_save(step, end_of_epoch, args.save_strategy):
                checkpoint(epoch, next_batch=index + 1)
            if step == schedule.total_steps:
                break
        epoch += 1
    progress.close()
    train_time = time.perf_counter() - train_start - eval_time

    # -- output ---------------------------------------------------------------------------------------
    exit_if_diverged(strategy, PROG, args.output_dir, metrics)
    answers = (sample_answers(reft_model, tokenizer, args, position, num_layers)
               if args.num_sample_answers > 0 else None)
    save_output(reft_model, metrics, args.output_dir, finished_record(step, args, 1, len(dataset), fingerprint))
    peak = (", ".join(f"cuda:{gpu} {torch.cuda.max_memory_allocated(gpu) / 2**30:.2f} GiB" for gpu in gpus) if gpus
            else f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB resident")
    print(f"Trained to step {step} in {train_time:.0f}s ({window.tokens_seen / train_time:.0f} tokens/s, peak memory "
          f"{peak}); "
          f"{metrics.loss_summary()}. Interventions (pyreft format), arguments, metrics and loss.png in "
          f"{args.output_dir}/")
    if answers:
        print(answers)
    print(f"Done in {time.perf_counter() - started:.0f}s.")


def load_data_and_model(args, strategy, dtype, position: tuple[int, int]):
    """The data and the ReFT model; what can be checked is checked before the model's weights are loaded."""
    records, eval_records = load_splits(args.data_path, args.eval_data_path, args.eval_split_ratio,
                                        args.max_n_train_example, args.seed, args.field_map, args.data_split,
                                        args.data_config, args.data_format, args.eval_data_split)
    model_path = check_model(args)  # --layers and --rank against the model's config, the chat template
    model, tokenizer = strategy.load_base(model_path, dtype, args.cache_dir)
    dataset, eval_dataset = [None if split is None
                             else prepare_dataset(split, tokenizer, args.model_max_length, args.cache_dir,
                                                  args.prompt_template)
                             for split in (records, eval_records)]
    set_attention(model, args.attn_implementation)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if args.torch_compile:
        compile_decoder_layers(model)
    torch.manual_seed(args.seed)  # the interventions' initial weights depend on the seed only
    reft_model = build_reft_model(model, args.layers, position, args.share_weights, low_rank_dimension=args.rank,
                                  dropout=args.dropout, intervention=args.intervention, component=args.component)
    num_layers = num_intervened_layers(reft_model, position, args.share_weights)
    collate = Collator(tokenizer.pad_token_id, position, args.share_weights, num_layers, args.pad_to_multiple_of)
    fingerprint = training_fingerprint(args, records, model)  # what its checkpoints are bound to
    return tokenizer, reft_model, dataset, eval_dataset, num_layers, collate, fingerprint


if __name__ == "__main__":
    main(ARGS)
