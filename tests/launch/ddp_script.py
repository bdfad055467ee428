"""A plain PyTorch DDP script, as a user would write it for torchrun: nothing lockstep-specific.
Prints the sum of its parameters after two steps, so the test can compare ranks."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(1234 + rank)  # different initial weights: DDP must broadcast rank 0's
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    x = torch.randn(4, 8)  # different data per rank
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
total = sum(p.detach().double().sum().item() for p in model.parameters())
print(f"PARAMS rank={rank} world={dist.get_world_size()} sum={total:.12e}", flush=True)
dist.destroy_process_group()
