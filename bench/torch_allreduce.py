"""The PyTorch peer for bench/compare_allreduce.py: torch.distributed (gloo) running the same
sweep as `lockstep bench allreduce`. Started once per rank with RANK/WORLD_SIZE/MASTER_*."""
import json
import sys
import time

import torch
import torch.distributed as dist


def main():
    min_bytes, max_bytes = int(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    bytes_ = min_bytes
    while bytes_ <= max_bytes:
        t = torch.full((bytes_ // 4,), float(rank + 1))
        iters = max(5, min(2000, (512 << 20) // bytes_))
        for _ in range(5):
            dist.all_reduce(t)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(t)
        mean = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64)
        dist.all_reduce(mean, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(json.dumps({"bytes": bytes_, "time_us": mean.item() * 1e6, "iters": iters}), flush=True)
        bytes_ *= 2
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
