#!/usr/bin/python3
"""A plain PyTorch DDP training script, as one writes it for torchrun: nothing lockstep-specific.
The backend string is its first argument (the only difference between a gloo and a lockstep
run); every rank saves its final parameters and its losses to OUT_DIR/rank<N>.pt.

    ddp_train.py BACKEND OUT_DIR [--steps N] [--hidden H] [--bucket-cap-mb MB] [--no-init]

--no-init: the script creates no process group; `lockstep run --torch-backend BACKEND` has made one.
"""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("backend")
    ap.add_argument("out_dir")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--bucket-cap-mb", type=float, default=0.01)
    ap.add_argument("--no-init", action="store_true", help="the launcher made the process group")
    args = ap.parse_args()

    if not args.no_init:
        dist.init_process_group(args.backend)
    if dist.get_backend() != args.backend:
        raise SystemExit(f"the group runs on {dist.get_backend()}, not on {args.backend}")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)  # different initial weights: DDP must broadcast rank 0's
    h = args.hidden
    model = nn.Sequential(nn.Linear(20, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                          nn.Linear(h, 4))
    # Small buckets by default: several all-reduces per step, overlapping backward.
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(1000 + rank)  # different data per rank
    losses = []
    for _ in range(args.steps):
        x = torch.randn(32, 20, generator=data)
        y = torch.randint(0, 4, (32,), generator=data)
        loss = F.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {k: v.detach() for k, v in model.named_parameters()}
    torch.save({"state": model.state_dict(), "params": params, "losses": losses},
               os.path.join(args.out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
