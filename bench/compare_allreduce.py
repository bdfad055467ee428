#!/usr/bin/python3
"""Allreduce, lockstep against its peers, in one run on this machine: lockstep shm and gloo
(`lockstep bench allreduce --json`), Open MPI's MPI_Allreduce (bench/mpi_allreduce.c) and
torch.distributed gloo (Debian's python3-torch, and PyTorch 2.x's with --torch2-python). 2 ranks, f32 sum, one thread per rank.
Each pair compares the same operation: lockstep shm and MPI go from a send buffer to a receive
buffer; lockstep gloo and torch gloo reduce in place (torch's all_reduce has no other form, and
DDP's buckets are reduced in place). Prints a markdown table with busbw and the ratios
lockstep-shm / MPI and lockstep-gloo / torch-gloo.

    /usr/bin/python3 bench/compare_allreduce.py [--build build] [--max-bytes N] [--ranks 2]
"""
import argparse
import json
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_lines(text):
    return {row["bytes"]: row for row in (json.loads(l) for l in text.splitlines() if l.startswith("{\"bytes\""))}


def run_lockstep(build, backend, ranks, lo, hi, in_place):
    out = subprocess.run([os.path.join(build, "tools", "lockstep"), "bench", "allreduce", "--nproc", str(ranks),
                          "--backend", backend, "--min-bytes", str(lo), "--max-bytes", str(hi), "--json"] +
                         (["--in-place"] if in_place else []),
                         check=True, capture_output=True, text=True).stdout
    # The launcher prefixes each worker line with "[rank N] "; rank 0 prints the JSON.
    text = "\n".join(l[len("[rank 0] "):] for l in out.splitlines() if l.startswith("[rank 0] "))
    return {row["bytes"]: row for row in json.loads(text)["rows"]}


def run_mpi(build, ranks, lo, hi):
    binary = os.path.join(build, "bench", "mpi_allreduce")
    out = subprocess.run(["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(ranks),
                          binary, str(lo), str(hi)], check=True, capture_output=True, text=True).stdout
    return parse_lines(out)


def run_torch(ranks, lo, hi, python="/usr/bin/python3"):
    port = free_port()
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([python, os.path.join(HERE, "torch_allreduce.py"), str(lo), str(hi)],
                                      env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("torch.distributed run failed")
    return parse_lines(outs[0])


def human(n):
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--min-bytes", type=int, default=4096)
    ap.add_argument("--max-bytes", type=int, default=256 << 20)
    ap.add_argument("--rounds", type=int, default=3,
                    help="sweeps per side, interleaved; each size keeps its best time (noise only adds time)")
    ap.add_argument("--torch2-python", default=os.path.expanduser("~/.cache/lockstep/venv-torch-2.15.0/bin/python"),
                    help="a python with PyTorch 2.x for a second torch gloo side (skipped when absent)")
    args = ap.parse_args()
    lo, hi, n = args.min_bytes, args.max_bytes, args.ranks
    runners = {
        "lockstep shm": lambda: run_lockstep(args.build, "shm", n, lo, hi, in_place=False),
        "lockstep gloo": lambda: run_lockstep(args.build, "gloo", n, lo, hi, in_place=True),
        "Open MPI": lambda: run_mpi(args.build, n, lo, hi),
        "torch gloo": lambda: run_torch(n, lo, hi),
    }
    if os.path.exists(args.torch2_python):
        runners["torch 2.x gloo"] = lambda: run_torch(n, lo, hi, args.torch2_python)
    sides = {k: {} for k in runners}
    for _ in range(args.rounds):
        for name, run in runners.items():
            for size, row in run().items():
                best = sides[name].get(size)
                if best is None or row["time_us"] < best["time_us"]:
                    sides[name][size] = row
    factor = 2 * (n - 1) / n if n > 1 else 1
    names = list(sides)
    print(f"allreduce f32 sum, {n} ranks, 1 thread per rank (no BLAS involved); best of {args.rounds} interleaved "
          f"sweeps per size; time in us, busbw in GB/s; shm and MPI send -> receive, both gloo sides in place\n")
    two = "torch 2.x gloo" in sides
    head = ("| size | " + " | ".join(f"{k} us | {k} busbw" for k in names) + " | shm/MPI | gloo/torch |"
            + (" gloo/torch 2.x |" if two else ""))
    print(head)
    print("|" + "---|" * (1 + 2 * len(names) + 2 + two))
    size = lo
    while size <= hi:
        cells, bw = [], {}
        for k in names:
            t = sides[k][size]["time_us"]
            bw[k] = size / (t * 1e-6) / 1e9 * factor
            cells += [f"{t:.1f}", f"{bw[k]:.2f}"]
        print(f"| {human(size)} | " + " | ".join(cells) +
              f" | {bw['lockstep shm'] / bw['Open MPI']:.2f}x | {bw['lockstep gloo'] / bw['torch gloo']:.2f}x |"
              + (f" {bw['lockstep gloo'] / bw['torch 2.x gloo']:.2f}x |" if two else ""))
        size *= 2
    wrong = sum(r.get("wrong", 0) for k in ("lockstep shm", "lockstep gloo") for r in sides[k].values())
    print(f"\nlockstep correctness check: {wrong} wrong elements")
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
