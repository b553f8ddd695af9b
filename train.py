"""Train LoReFT interventions on Alpaca instruction data, on one device.

    python train.py                      # SmolLM2-135M-Instruct on the shipped sample data, ~4 min on a CPU
    python train.py --model_name_or_path meta-llama/Llama-3.2-1B --data_path alpaca_data.json \
        --layers "8;19" --rank 4 --position "f1+l1" --learning_rate 2e-5 ...

Several GPUs: `torchrun --nproc_per_node N train_multigpu.py` with the same flags trains the same model.
"""

import os
import sys

from alpaca.args import UsageError, exit_on_usage_error, parse_args

PROG = "train.py"


def main(argv: list[str] | None = None) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        # Every rank would train on all the data and they would overwrite each other's output.
        sys.exit(f"{PROG}: error: launched on {world_size} processes (WORLD_SIZE={world_size}); train.py trains on "
                 f"one device. Use: torchrun --nproc_per_node {world_size} train_multigpu.py <same flags>")
    args = parse_args(PROG, argv)  # before the heavy imports: --help and usage errors are instant
    try:
        train(args)
    except UsageError as error:
        exit_on_usage_error(PROG, error)


def train(args) -> None:
    import math
    import time

    import torch
    from tqdm.auto import tqdm
    from transformers import get_scheduler

    from alpaca.args import parse_position
    from alpaca.data import Collator, global_batches, load_records, rank_micro_batches, steps_per_epoch, tokenize
    from alpaca.generation import SAMPLE_INSTRUCTIONS, answer, side_by_side
    from alpaca.loss import summed_token_loss, token_weighted_loss
    from alpaca.model import (
        build_reft_model,
        intervention_parameters,
        load_base_model,
        optimizer_param_groups,
        resolve_dtype,
    )
    from alpaca.output import MetricsLog, plot_loss, read_metrics, save_args, save_interventions

    started = time.perf_counter()
    # -- device: one, never nn.DataParallel ---------------------------------------------------------
    if torch.cuda.is_available():
        device = torch.device("cuda:0")
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        if torch.cuda.device_count() > 1:
            print(f"{torch.cuda.device_count()} GPUs visible; train.py uses cuda:0. To train on all of them: "
                  f"torchrun --nproc_per_node {torch.cuda.device_count()} train_multigpu.py <same flags>")
    else:
        device = torch.device("cpu")
    torch.manual_seed(args.seed)
    position = parse_position(args.position)

    # -- data and model ---------------------------------------------------------------------------
    records = load_records(args.data_path, args.max_n_train_example, args.seed)
    model, tokenizer = load_base_model(args.model_name_or_path, resolve_dtype(args.dtype, device), device,
                                       args.model_max_length, args.cache_dir)
    dataset = tokenize(records, tokenizer, args.model_max_length)
    torch.manual_seed(args.seed)  # intervention init depends on the seed only
    reft_model = build_reft_model(model, args.layers, position, args.share_weights, args.rank, args.dropout,
                                  args.intervention)
    num_layers = len(reft_model.interventions) // (2 if position[0] and position[1] and not args.share_weights else 1)
    collate = Collator(tokenizer.pad_token_id, position, args.share_weights, num_layers)
    parameters = [parameter for _, parameter in intervention_parameters(reft_model)]

    # -- optimization plan: global batch = per_device x world_size (1) x accumulation ----------------
    global_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
    epoch_steps = steps_per_epoch(len(dataset), global_batch_size)
    total_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * epoch_steps)
    warmup_steps = args.warmup_steps if args.warmup_steps > 0 else math.ceil(args.warmup_ratio * total_steps)
    optimizer = torch.optim.AdamW(optimizer_param_groups(reft_model, args.weight_decay), lr=args.learning_rate,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=warmup_steps,
                              num_training_steps=total_steps)
    logging_interval = max(1, math.ceil(args.logging_steps * total_steps if args.logging_steps < 1
                                        else args.logging_steps))
    print(f"{len(dataset)} examples | {sum(p.numel() for p in parameters):,} trainable parameters in "
          f"{len(reft_model.interventions)} interventions | base model {sum(p.numel() for p in model.parameters()):,} "
          f"parameters ({model.dtype}) on {device}\n"
          f"global batch {global_batch_size} = {args.per_device_train_batch_size} per device x "
          f"{args.gradient_accumulation_steps} accumulation | {total_steps} steps ({epoch_steps} per epoch) | "
          f"ready in {time.perf_counter() - started:.1f}s")

    # -- train --------------------------------------------------------------------------------------
    os.makedirs(args.output_dir, exist_ok=True)
    save_args(args, args.output_dir, world_size=1, global_batch_size=global_batch_size, total_steps=total_steps)
    metrics = MetricsLog(args.output_dir)
    progress = tqdm(total=total_steps, desc="training", dynamic_ncols=True)
    step, window_loss, window_tokens, window_seen, window_start = 0, 0.0, 0, 0, time.perf_counter()
    train_start, total_seen = time.perf_counter(), 0
    epoch = 0
    while step < total_steps:
        for global_batch in global_batches(len(dataset), global_batch_size, args.seed, epoch):
            micro_batches = rank_micro_batches(global_batch, 0, 1, args.per_device_train_batch_size,
                                               args.gradient_accumulation_steps)
            batches = [collate([dataset[i] for i in indices]) for indices in micro_batches if indices]
            step_label_tokens = sum(batch["num_label_tokens"] for batch in batches)
            learning_rate = scheduler.get_last_lr()[0]
            for batch in batches:
                summed_loss = summed_token_loss(reft_model, batch, device)
                token_weighted_loss(summed_loss, step_label_tokens).backward()
                window_loss += summed_loss.item()
                window_seen += int(batch["attention_mask"].sum())
            window_tokens += step_label_tokens
            grad_norm = torch.nn.utils.clip_grad_norm_(parameters, args.max_grad_norm if args.max_grad_norm > 0
                                                       else math.inf)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            progress.update()
            if step % logging_interval == 0 or step == total_steps:
                elapsed = time.perf_counter() - window_start
                record = {"step": step, "epoch": round(step / epoch_steps, 4), "loss": window_loss / window_tokens,
                          "learning_rate": learning_rate, "grad_norm": float(grad_norm),
                          "tokens_per_s": window_seen / elapsed, "elapsed_s": time.perf_counter() - train_start}
                metrics.write(record)
                progress.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{learning_rate:.2e}",
                                     tok_s=f"{record['tokens_per_s']:.0f}")
                total_seen += window_seen
                window_loss, window_tokens, window_seen, window_start = 0.0, 0, 0, time.perf_counter()
            if step == total_steps:
                break
        epoch += 1
    progress.close()
    train_time = time.perf_counter() - train_start

    # -- output ---------------------------------------------------------------------------------------
    save_interventions(reft_model, args.output_dir)
    plot_loss(args.output_dir)
    losses = [r["loss"] for r in read_metrics(args.output_dir)]
    print(f"Trained {step} steps in {train_time:.0f}s ({total_seen / train_time:.0f} tokens/s); loss "
          f"{losses[0]:.4f} -> {losses[-1]:.4f}. Interventions, arguments, metrics and loss.png in "
          f"{args.output_dir}/ (load with pyreft.ReftModel.load)")
    if args.num_sample_answers > 0:
        rows = [(instruction, *answer(reft_model, tokenizer, instruction, position, args.share_weights, num_layers,
                                      args.max_new_tokens))
                for instruction in SAMPLE_INSTRUCTIONS[: args.num_sample_answers]]
        print(side_by_side(rows))
    print(f"Done in {time.perf_counter() - started:.0f}s.")


if __name__ == "__main__":
    main()
