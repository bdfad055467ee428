#!/usr/bin/env python3
"""A transformers.Trainer fine-tune of a small BERT classifier (fortune_data.py) under
`lockstep run` (or torchrun), on the backend named by argv[1].

Hugging Face picks the backend itself: TrainingArguments' ddp_backend takes only its own list
(nccl, gloo, mpi, ...), and on CPU Accelerate's PartialState uses gloo whatever it is given.
Both create the process group only when none exists, so the ways in are to create it first,
dist.init_process_group("lockstep"), or to have `lockstep run --torch-backend lockstep` create it
(--no-init below); the Trainer's DDP then runs on it.

Rank 0 prints one JSON line: {"backend", "world", "losses", "seconds_per_step"} (the losses as
the Trainer logs them, rounded to 4 digits). Every rank writes OUT_DIR/rank<r>.pt: its own loss of
every step before any rounding (what training_step returned) and its parameters at the end.

    trainer_train.py BACKEND OUT_DIR --tokenizer DIR [--steps N] [--no-init]

--no-init makes it the unmodified script: it creates no process group, so Hugging Face creates
one (gloo on CPU), unless `lockstep run --torch-backend B` had one created as torch was imported
(tests/python/test_pip.py); BACKEND then only names the run.
"""
import argparse
import json
import time

import torch
import torch.distributed as dist

import fortune_data


class StepClock:
    """A TrainerCallback's two hooks: the wall time of every optimizer step after the first."""

    def __init__(self):
        self.times = []

    def __call__(self):
        from transformers import TrainerCallback
        clock = self

        class Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                clock.times.append(time.perf_counter())

        return Callback()

    def seconds_per_step(self):
        gaps = [b - a for a, b in zip(self.times, self.times[1:])]
        return sorted(gaps)[len(gaps) // 2] if gaps else float("nan")


def unrounded_losses_trainer():
    """transformers.Trainer keeping each step's loss on this rank as training_step returns it (the
    logged losses are rounded to 4 digits and averaged over ranks: they can hide a difference)."""
    from transformers import Trainer

    class Recording(Trainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.unrounded = []

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.unrounded.append(loss.detach().item())
            return loss

    return Recording


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("backend")
    ap.add_argument("out_dir")
    ap.add_argument("--tokenizer", required=True, help="a directory fortune_data.py saved")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--no-init", action="store_true", help="leave the process group to Hugging Face")
    args = ap.parse_args()

    if not args.no_init:
        dist.init_process_group(args.backend)  # before transformers: it then uses this group
    from transformers import TrainingArguments
    UnroundedLosses = unrounded_losses_trainer()

    torch.manual_seed(0)
    rows = fortune_data.labelled()
    tokenizer = fortune_data.load_tokenizer(args.tokenizer)
    data = fortune_data.Encoded(rows, tokenizer)
    model = fortune_data.small_bert(len(tokenizer))
    training = TrainingArguments(output_dir=args.out_dir, per_device_train_batch_size=16, max_steps=args.steps,
                                 learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=1, seed=0,
                                 report_to=[], save_strategy="no", use_cpu=True, dataloader_num_workers=0,
                                 disable_tqdm=True)
    clock = StepClock()
    trainer = UnroundedLosses(model=model, args=training, train_dataset=data, callbacks=[clock()])
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    torch.save({"losses": trainer.unrounded, "parameters": [p.detach().clone() for p in model.parameters()]},
               f"{args.out_dir}/rank{dist.get_rank()}.pt")
    if dist.get_rank() == 0:
        print(json.dumps({"backend": args.backend, "world": dist.get_world_size(), "losses": losses,
                          "seconds_per_step": clock.seconds_per_step(),
                          "group": dist.get_backend()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
