#!/usr/bin/python3
"""PyTorch's own tensor parallelism (DTensor, torch.distributed.tensor.parallel, torch 2.x) on CPU:
a small transformer block (layer norm, an MLP of a column- then a row-parallel linear, a residual)
split with parallelize_module over every rank as one tensor group, with sequence parallelism on the
norm and the residual stream, trained with Adam; rank 0 saves the full parameters and its losses
to OUT_FILE.

    dtensor_tp_train.py BACKEND OUT_FILE [--steps N]     (BACKEND: e.g. lockstep, gloo)
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)


class Block(nn.Module):
    def __init__(self, width=32, hidden=128):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, hidden)
        self.proj = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("backend")
    ap.add_argument("out_file")
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(7)
    model = Block()
    # The sequence (dimension 1) split between layers; gathered into the column-parallel fc, and
    # reduce-scattered out of the row-parallel proj: Megatron's sequence parallelism.
    parallelize_module(model, mesh, {
        "norm": SequenceParallel(),
        "fc": ColwiseParallel(input_layouts=Shard(1)),
        "proj": RowwiseParallel(output_layouts=Shard(1)),
    })
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    teacher = torch.randn(32, 32, generator=torch.Generator().manual_seed(3))
    data = torch.Generator().manual_seed(500)  # every rank the same batch: one tensor group
    losses = []
    for _ in range(args.steps):
        x = torch.randn(4, 8 * world, 32, generator=data)
        # Each rank's shard of the sequence in, its shard of the output back.
        mine = x.chunk(world, dim=1)[rank]
        out = model(mine)
        target = torch.tanh(x @ teacher).chunk(world, dim=1)[rank]
        local = F.mse_loss(out, target, reduction="sum")
        loss = local.detach().clone()
        dist.all_reduce(loss)
        (local / x.numel()).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item() / x.numel())
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save({"state": full, "losses": losses, "backend": dist.get_backend()}, args.out_file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
