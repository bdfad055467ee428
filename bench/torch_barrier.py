"""The torchrun side of bench/compare_launch.py: init gloo from env, one barrier, print the time."""
import time

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
print(f"PAST_BARRIER {time.time():.6f}", flush=True)
dist.destroy_process_group()
