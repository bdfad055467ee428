#!/usr/bin/env python3
"""An Accelerate training loop for the small BERT classifier (fortune_data.py) under
`lockstep run` (or torchrun), on the backend named by argv[1]. As with the Trainer, Accelerate
uses gloo on CPU whatever it is told, unless a process group exists already: the script creates
it first (dist.init_process_group("lockstep")), and Accelerate's DDP runs on it.

Rank 0 prints one JSON line: {"backend", "world", "losses", "seconds_per_step"}.

    accelerate_train.py BACKEND --tokenizer DIR [--steps N]
"""
import argparse
import json
import time

import torch
import torch.distributed as dist

import fortune_data


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("backend")
    ap.add_argument("--tokenizer", required=True, help="a directory fortune_data.py saved")
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()

    dist.init_process_group(args.backend)  # before Accelerate: it then uses this group
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    rows = fortune_data.labelled()
    tokenizer = fortune_data.load_tokenizer(args.tokenizer)
    data = fortune_data.Encoded(rows, tokenizer)
    model = fortune_data.small_bert(len(tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True,
                                         generator=torch.Generator().manual_seed(0))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model.train()
    losses, stamps = [], []
    while len(losses) < args.steps:
        for batch in loader:
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
            stamps.append(time.perf_counter())
            if len(losses) == args.steps:
                break
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    if accelerator.is_main_process:
        print(json.dumps({"backend": args.backend, "world": accelerator.num_processes, "losses": losses,
                          "seconds_per_step": gaps[len(gaps) // 2], "group": dist.get_backend()}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
