#!/usr/bin/python3
"""Machines of unequal size (2 workers and 1): lockstep's hier against flat gloo, in one run.

Two network namespaces (bench/compare_cluster.py's Cluster) at --rate, machine 0 with 2 workers
and machine 1 with 1, one `lockstep run` per machine. For each size, `lockstep bench allreduce`
over hier and over gloo (interleaved, --repeat times): the time per all-reduce (slowest rank)
and the bytes machine 0's link carried each way per all-reduce, against the size S. Then the
784-1024-1024-10 MLP's DDP throughput (bench/ddp_bench.cc) over each.

    sudo /usr/bin/python3 bench/compare_uneven.py [--rate 1gbit] [--sizes 4194304,67108864]
        [--repeat 3] [--out bench/UNEVEN.md]
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from compare_cluster import Cluster, cpu, sh  # noqa: E402

PORT = 29400
WORKERS = [2, 1]  # per machine


def launch(cluster, build, program, timeout=900):
    """One `lockstep run` per machine, WORKERS[m] workers on machine m; rank 0's JSON line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", LOCKSTEP_TOKEN="bench-token")
    procs = []
    for m, nproc in enumerate(WORKERS):
        argv = [f"{build}/tools/lockstep", "run", "--nnodes", str(len(WORKERS)), "--node-rank", str(m),
                "--nproc-per-node", str(nproc), "--master-addr", cluster.address(0), "--master-port", str(PORT)]
        procs.append(subprocess.Popen(cluster.on(m, argv + program), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env))
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outputs):
        if p.returncode != 0:
            raise SystemExit(f"failed ({p.returncode}): {' '.join(program)}\n{out}")
    text = "\n".join(line.split("] ", 1)[-1] if line.startswith("[") else line for line in outputs[0].splitlines())
    start = text.find("{")
    return json.JSONDecoder().raw_decode(text[start:])[0]


def allreduce(cluster, build, backend, size, iters):
    before = cluster.bytes(0)
    doc = launch(cluster, build, [f"{build}/tools/lockstep", "bench", "allreduce", "--backend", backend,
                                  "--min-bytes", str(size), "--max-bytes", str(size), "--iters", str(iters),
                                  "--warmup", "1", "--json"])
    after = cluster.bytes(0)
    row = doc["rows"][0]
    runs = 1 + 1 + iters  # the correctness check, the warm-up, the timed ones
    return {"time": row["time_us"] / 1e6, "wrong": row["wrong"], "tx": (after[0] - before[0]) / runs,
            "rx": (after[1] - before[1]) / runs}


def ddp(cluster, build, backend, steps):
    return launch(cluster, build, [f"{build}/bench/ddp_bench", "--model", "mlp", "--steps", str(steps),
                                   "--backend", backend])["samples_per_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--sizes", default=f"{4 << 20},{64 << 20}")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(HERE, "UNEVEN.md"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("compare_uneven.py makes network namespaces: run it as root")
    sizes = [int(s) for s in args.sizes.split(",")]
    cluster = Cluster(len(WORKERS), args.rate)
    try:
        runs = {(b, s): [] for b in ["hier", "gloo"] for s in sizes}
        rates = {"hier": [], "gloo": []}
        for _ in range(args.repeat):
            for size in sizes:
                for backend in ["hier", "gloo"]:
                    runs[(backend, size)].append(allreduce(cluster, args.build, backend, size, args.iters))
                    print(backend, size, runs[(backend, size)][-1], flush=True)
            for backend in rates:
                rates[backend].append(ddp(cluster, args.build, backend, args.steps))
                print("ddp", backend, rates[backend][-1], flush=True)
    finally:
        cluster.close()
    lines = ["# Machines of unequal size: hier against flat gloo", "",
             f"{datetime.date.today()}, {cpu()}, {os.cpu_count()} cores shared by the machines, commit "
             f"{sh('git', '-C', ROOT, 'rev-parse', '--short', 'HEAD').strip()}; 2 namespace machines at {args.rate}, "
             f"machine 0 with 2 workers, machine 1 with 1; one intra-op and one BLAS thread per worker (BLAS: "
             f"{os.path.realpath('/etc/alternatives/libblas.so.3-x86_64-linux-gnu')}).",
             f"Command: `sudo /usr/bin/python3 bench/compare_uneven.py {' '.join(sys.argv[1:])}`", "",
             "| all-reduce of S | backend | time (median) | machine 0's link out / in per all-reduce | wrong |",
             "|---|---|---|---|---|"]
    for size in sizes:
        for backend in ["hier", "gloo"]:
            r = runs[(backend, size)]
            lines.append(f"| {size >> 20} MiB | {backend} | {statistics.median(x['time'] for x in r) * 1e3:.1f} ms | "
                         f"{statistics.median(x['tx'] for x in r) / size:.2f} S / "
                         f"{statistics.median(x['rx'] for x in r) / size:.2f} S | {max(x['wrong'] for x in r)} |")
    lines += ["", "| DDP, the MLP, batch 64 per worker | samples/s (median) | runs |", "|---|---|---|"]
    for backend, r in rates.items():
        lines.append(f"| {backend} | {statistics.median(r):.0f} | {', '.join(f'{x:.0f}' for x in r)} |")
    hier, gloo = statistics.median(rates["hier"]), statistics.median(rates["gloo"])
    lines += ["", f"hier / gloo on DDP: {hier / gloo:.2f}x."]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
