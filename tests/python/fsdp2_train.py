#!/usr/bin/python3
"""FSDP2 (torch.distributed.fsdp.fully_shard, torch 2.x) on CPU: an MLP with each Linear and the
whole model sharded, trained with Adam on a learnable target; rank 0 saves the full parameters
(gathered from the shards) and its losses to OUT_FILE.

    fsdp2_train.py BACKEND OUT_FILE [--steps N]      (BACKEND: e.g. lockstep, cpu:lockstep, gloo)
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("backend")
    ap.add_argument("out_file")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    teacher = torch.randn(32, 8, generator=torch.Generator().manual_seed(3))
    data = torch.Generator().manual_seed(500 + rank)
    losses = []
    for _ in range(args.steps):
        x = torch.randn(64, 32, generator=data)
        loss = F.cross_entropy(model(x), (x @ teacher).argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    full = {k: v.full_tensor() for k, v in model.state_dict().items()}  # collective: every rank
    if rank == 0:
        torch.save({"state": full, "losses": losses, "backend": dist.get_backend()}, args.out_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
