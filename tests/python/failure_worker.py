"""One rank of test_failure.py: all-reduces 16 MiB tensors until one fails, then prints
{"rank", "error", "raised_at"} and exits 3. After its first few rounds it prints "looping",
which tells the test it is safe to kill a rank in the middle of an all-reduce."""
import json
import sys
import time

import torch
import torch.distributed as dist


def main():
    dist.init_process_group("lockstep")
    rank = dist.get_rank()
    t = torch.ones(4 << 20)  # 16 MiB: each all-reduce takes milliseconds, in many shm rounds
    try:
        # Bounded: the test kills a rank within seconds of "looping"; a minute without an
        # error means the failure went unnoticed, and this rank says so rather than loop on.
        give_up = time.monotonic() + 60
        i = 0
        while time.monotonic() < give_up:
            dist.all_reduce(t)
            t.fill_(1.0)
            if i == 3:
                print("looping", flush=True)
            i += 1
    except RuntimeError as e:
        print(json.dumps({"rank": rank, "error": str(e), "raised_at": time.time()}), flush=True)
        sys.exit(3)
    print(json.dumps({"rank": rank, "error": None, "raised_at": None}), flush=True)
    sys.exit(4)


if __name__ == "__main__":
    main()
