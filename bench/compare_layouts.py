#!/usr/bin/python3
"""Four layouts of the same job across two machines: which dimension should cross the link.

Two machines as network namespaces (compare_cluster.py's), two workers each, their link limited
with tc tbf to --rates. The 8 x 512 GPT (25 M parameters, 128 bytes of context, dropout 0, no
clipping), steps of --micro-batches micro-batches of --micro-batch sequences per replica, one
intra-op and one BLAS thread per worker, each layout's runs interleaved --repeat times, the first
logging window of every run not timed. Layouts (world 4 = P x D x T, numbered with the tensor rank
innermost, so a machine holds 2 neighbouring ranks):

  DDP                      4 data ranks (hier: shared memory inside a machine, the link between)
  2 pipeline x 2 data      each machine one stage, its 2 replicas inside it; activations cross
  2 pipeline x 2 tensor    each machine one stage split over its 2 workers (3-D without data)
  2 data x 2 tensor        each machine one replica split over its 2 workers; gradients cross

Tokens/s counts each replica's tokens once (a tensor group's shared batch once). The sides run
different numbers of replicas (DDP 4, the others 2 or 1), so each step trains a different number
of tokens: the figure to compare is tokens/s, at the same per-replica batch.

Then `lockstep plan` is asked, as a user would before running anything: from a one-worker run of
the same GPT on this machine (its measured step), the link's rate, the shared-memory bus bandwidth
`lockstep bench allreduce` measures for 2 workers, and 1 core per machine (the two namespace
machines share this host's two cores). The table gives its first pick among the measured layouts
and that layout's measured tokens/s against the fastest measured.

    sudo /usr/bin/python3 bench/compare_layouts.py [--build build] [--rates 100mbit] [--repeat 2]
        [--steps 12] [--micro-batches 4] [--micro-batch 2] [--out out.md]

The machines share this host's two cores (four workers on two cores): what is measured is each
layout's traffic against the others' at one link speed, in one run; the header names the CPU and
the BLAS.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

import compare_cluster
import compare_ddp
import compare_pipeline

BIG_GPT = ["--n-layer", "8", "--n-embd", "512", "--n-head", "8"]
KERNELS = set()  # what each run's train_begin record says its BLAS multiplied with
LAYOUTS = {
    "DDP, 4 data ranks": [],
    "2 pipeline x 2 data": ["--pipeline-parallel", "2"],
    "2 pipeline x 2 tensor": ["--pipeline-parallel", "2", "--tensor-parallel", "2"],
    "2 data x 2 tensor": ["--tensor-parallel", "2"],
}


def note_kernels(begin):
    """What a run's train_begin record says its BLAS multiplied with."""
    KERNELS.add(f"{begin.get('blas', '?')} ({begin.get('blas_core', '?')} kernels, "
                f"{begin.get('intra_op_threads', '?')} thread)")


def machine_link(build):
    """The bus bandwidth of shm all-reduces of 16 MB between 2 workers here, as `lockstep plan` takes it."""
    done = subprocess.run([f"{build}/tools/lockstep", "bench", "allreduce", "--nproc", "2", "--in-place",
                           "--min-bytes", str(16 << 20), "--max-bytes", str(16 << 20), "--json"],
                          capture_output=True, text=True, env=dict(os.environ, **compare_pipeline.ONE_THREAD))
    if done.returncode != 0:
        raise SystemExit(f"lockstep bench allreduce failed\n{done.stdout}{done.stderr}")
    text = "\n".join(line.split("] ", 1)[-1] for line in done.stdout.splitlines())  # the launcher's "[rank 0] "
    return json.loads(text)["rows"][-1]["busbw_gbps"] * 1e9  # GB/s, as nccl-tests


def plan_pick(args, rate):
    """`lockstep plan`'s first pick for these machines, from a one-worker run of the GPT here."""
    with tempfile.TemporaryDirectory(prefix="layoutplan-", dir="/tmp") as out:
        flags = compare_pipeline.gpt_flags(out, args.steps, args.micro_batches, args.micro_batch, BIG_GPT)
        cmd = [f"{args.build}/tools/lockstep", "run", "--nproc-per-node", "1", f"{args.build}/examples/gpt"] + flags
        done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, **compare_pipeline.ONE_THREAD))
        if done.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{done.stdout}{done.stderr}")
        link = machine_link(args.build)
        plan = [f"{args.build}/tools/lockstep", "plan", "--from-run", out, "--nnodes", "2", "--nproc-per-node", "2",
                "--cores", "1", "--link", rate, "--machine-link", f"{link / 1e6:.0f}MB/s", "--block-size", "128",
                "--vocab-size", "256"] + BIG_GPT
        done = subprocess.run(plan, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"failed: {' '.join(plan)}\n{done.stdout}{done.stderr}")
        print(done.stdout, flush=True)
        pick = done.stdout.split("first pick: ")[1].splitlines()[0].strip()
        return pick, " ".join(plan[1:]), done.stdout, link


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(compare_pipeline.ROOT, "build"))
    ap.add_argument("--rates", default="100mbit")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("compare_layouts.py makes network namespaces: run it as root")
    lines = [f"# Layouts across two machines ({datetime.date.today()}, {compare_ddp.cpu_name()}, {os.cpu_count()} cores)",
             "", f"`{' '.join(sys.argv)}`", "",
             f"The 8 x 512 GPT, 2 workers on each of 2 namespace machines, one intra-op and one BLAS thread per "
             f"worker; Debian's BLAS: {compare_ddp.blas()}. Steps of {args.micro_batches} micro-batches of "
             f"{args.micro_batch} x 128 bytes per replica; median of {args.repeat} runs of {args.steps} steps.", "",
             "| link | layout | tokens/s | vs DDP | exposed comm |", "|---|---|---|---|---|"]
    plans = ["", "## lockstep plan's first pick", ""]
    for rate in args.rates.split(","):
        cluster = compare_cluster.Cluster(2, rate)
        try:
            runs = {name: [] for name in LAYOUTS}
            comm = {name: [] for name in LAYOUTS}
            for _ in range(args.repeat):
                for name, extra in LAYOUTS.items():
                    logs = compare_pipeline.cluster_run(cluster, args.build, lambda out: compare_pipeline.gpt_flags(
                        out, args.steps, args.micro_batches, args.micro_batch, BIG_GPT + extra), nproc=2,
                        on_begin=note_kernels)
                    runs[name].append(compare_pipeline.mean_of(logs, "tokens_per_second"))
                    comm[name].append(compare_pipeline.mean_of(logs, "exposed_comm_fraction"))
                    print(rate, name, f"{runs[name][-1]:.0f} tokens/s", flush=True)
            ddp = statistics.median(runs["DDP, 4 data ranks"])
            for name, values in runs.items():
                med = statistics.median(values)
                lines.append(f"| {rate} | {name} | {med:.0f} | {med / ddp:.2f}x | "
                             f"{100 * statistics.median(comm[name]):.0f}% |")
        finally:
            cluster.close()
        pick, command, table, link = plan_pick(args, rate)
        # By lockstep plan's names ("4 data" is DDP).
        measured = {("4 data" if name.startswith("DDP") else name): statistics.median(v) for name, v in runs.items()}
        fastest = max(measured, key=measured.get)
        plans.append(f"- {rate}: `lockstep {command}` (shared memory measured at {link / 1e9:.2f} GB/s) picks "
                     f"**{pick}**; " + (f"measured {measured[pick]:.0f} tokens/s, {measured[pick] / measured[fastest]:.2f}x "
                                       f"the fastest measured ({fastest}, {measured[fastest]:.0f})" if pick in measured
                                       else "a layout not measured here") + ".")
        plans.append("")
        plans.append("```")
        plans.extend(table.rstrip().splitlines())
        plans.append("```")
    lines.insert(5, f"Each worker's BLAS, from the runs' train_begin records: {'; '.join(sorted(KERNELS))}.")
    text = "\n".join(lines + plans) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
