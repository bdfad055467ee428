#!/usr/bin/python3
"""Point-to-point round trips, lockstep's torch.distributed backend against torch's gloo, in one
run: 2 processes, each with a lockstep group (the default) and a gloo group of the same ranks;
rank 0 sends a float32 tensor and waits for it back (dist.send / dist.recv), rank 1 echoes it.
Rounds alternate between the two groups, so that both see the same machine; the figure is the
median round trip over the rounds. Prints a markdown table and the ratio gloo / lockstep (above
1: lockstep is faster).

    /usr/bin/python3 bench/compare_p2p.py [--build build] [--max-bytes N] [--rounds 7]
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

from compare_allreduce import free_port, human

HERE = os.path.dirname(os.path.abspath(__file__))


def sizes(max_bytes):
    n = 4
    while n <= max_bytes:
        yield n
        n *= 4


def round_trips(dist, torch, group, nbytes, iterations):
    """Seconds per round trip over `iterations`, after a warm-up."""
    t = torch.zeros(nbytes // 4)
    peer = 1 - dist.get_rank()
    for i in range(iterations + 3):
        if i == 3:
            start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(t, peer, group=group)
            dist.recv(t, peer, group=group)
        else:
            dist.recv(t, peer, group=group)
            dist.send(t, peer, group=group)
    return (time.perf_counter() - start) / iterations


def worker(max_bytes, rounds):
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("lockstep")
    groups = {"lockstep": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    for nbytes in sizes(max_bytes):
        iterations = max(20, min(2000, (64 << 20) // (nbytes * 40)))
        times = {name: [] for name in groups}
        for _ in range(rounds):
            for name, group in groups.items():
                times[name].append(round_trips(dist, torch, group, nbytes, iterations))
        if dist.get_rank() == 0:
            print("ROW", nbytes, statistics.median(times["lockstep"]), statistics.median(times["gloo"]), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    parser.add_argument("--max-bytes", type=int, default=4 << 20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.max_bytes, args.rounds)
    port = free_port()
    procs = []
    for r in range(2):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=os.path.join(os.path.abspath(args.build), "python"))
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--max-bytes", str(args.max_bytes),
                                       "--rounds", str(args.rounds)], env=env, stdout=subprocess.PIPE, text=True))
    out = [p.communicate()[0] for p in procs][0]
    if any(p.returncode for p in procs):
        raise SystemExit("a worker failed")
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    print(f"send/recv round trip, 2 processes on one machine ({cpu}, {os.cpu_count()} cores), float32, "
          f"median of {args.rounds} alternating rounds\n")
    print("| size | lockstep (us) | torch gloo (us) | gloo / lockstep |")
    print("|---:|---:|---:|---:|")
    for line in out.splitlines():
        if line.startswith("ROW "):
            _, nbytes, mine, gloo = line.split()
            mine, gloo = float(mine), float(gloo)
            print(f"| {human(int(nbytes))} | {mine * 1e6:.0f} | {gloo * 1e6:.0f} | {gloo / mine:.2f}x |")


if __name__ == "__main__":
    main()
