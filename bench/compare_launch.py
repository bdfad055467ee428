#!/usr/bin/python3
"""Launcher start-up, lockstep against its peers, in one run: the time from starting the
launcher to both workers being past their first barrier (the latest PAST_BARRIER stamp a worker
prints, minus the moment the launcher was started), for `lockstep run --nproc-per-node 2`,
`torchrun --nproc-per-node 2` (Debian's python3-torch 1.13; it needs --redirects 1 --tee 1 to
start on Python 3.11), the torchrun of PyTorch 2.x (--torch2-python; skipped when absent) and
`mpirun -np 2`. Runs each --repeat times, interleaved, and prints the median and range as a
markdown table.

    /usr/bin/python3 bench/compare_launch.py [--build build] [--repeat 7]
        [--torch2-python ~/.cache/lockstep/venv-torch-2.15.0/bin/python]
"""
import argparse
import os
import re
import statistics
import subprocess
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def measure(cmd):
    start = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    stamps = [float(x) for x in re.findall(r"PAST_BARRIER (\d+\.\d+)", out.stdout + out.stderr)]
    if out.returncode != 0 or len(stamps) != 2:
        raise SystemExit(f"{cmd[0]} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return max(stamps) - start


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--torch2-python", default=os.path.expanduser("~/.cache/lockstep/venv-torch-2.15.0/bin/python"))
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    sides = {
        "lockstep run": [os.path.join(build, "tools", "lockstep"), "run", "--nproc-per-node", "2",
                         os.path.join(build, "bench", "launch_worker")],
        "torchrun": ["/usr/bin/python3", "-m", "torch.distributed.run", "--nproc_per_node", "2", "--redirects", "1",
                     "--tee", "1", os.path.join(HERE, "torch_barrier.py")],
        "torchrun 2.x": [args.torch2_python, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                         os.path.join(HERE, "torch_barrier.py")],
        "mpirun": ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", os.path.join(build, "bench", "mpi_barrier")],
    }
    if not os.path.exists(args.torch2_python):
        del sides["torchrun 2.x"]
    times = {k: [] for k in sides}
    for _ in range(args.repeat):
        for name, cmd in sides.items():
            times[name].append(measure(cmd))
    base = statistics.median(times["lockstep run"])
    print(f"launch of 2 workers to past their first barrier, {args.repeat} runs each, interleaved\n")
    print("| launcher | median s | min s | max s | vs lockstep run |")
    print("|---|---|---|---|---|")
    for name, t in times.items():
        med = statistics.median(t)
        print(f"| {name} | {med:.3f} | {min(t):.3f} | {max(t):.3f} | {med / base:.1f}x |")


if __name__ == "__main__":
    main()
