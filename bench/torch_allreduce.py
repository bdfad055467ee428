"""The PyTorch peer for bench/compare_allreduce.py and bench/compare_torch_backend.py:
torch.distributed running the same sweep as `lockstep bench allreduce`. Started once per rank
with RANK/WORLD_SIZE/MASTER_* (or under lockstep run).

    torch_allreduce.py MIN_BYTES MAX_BYTES [BACKEND]     BACKEND: gloo (default) or lockstep

Rank 0 prints one JSON line per size: bytes, time_us (the slower rank's mean per call), iters,
and wrong (elements a 256 KiB all_reduce checked at the start got wrong)."""
import json
import sys
import time

import torch
import torch.distributed as dist


def wrong_elements(rank, world):
    check = torch.arange(1 << 16, dtype=torch.float32) + rank
    dist.all_reduce(check)
    want = torch.arange(1 << 16, dtype=torch.float32) * world + world * (world - 1) / 2
    return int((check != want).sum())


def main():
    min_bytes, max_bytes = int(sys.argv[1]), int(sys.argv[2])
    backend = sys.argv[3] if len(sys.argv) > 3 else "gloo"
    torch.set_num_threads(1)
    dist.init_process_group(backend)
    rank = dist.get_rank()
    wrong = wrong_elements(rank, dist.get_world_size())
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
            print(json.dumps({"bytes": bytes_, "time_us": mean.item() * 1e6, "iters": iters, "wrong": wrong}),
                  flush=True)
        bytes_ *= 2
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
