#!/usr/bin/python3
"""What a checkpoint costs the training: today's consolidated save (ZeRO's slices gathered on
rank 0, which writes model.pt and optimizer.pt) against sharded saves (every rank writes its own
shard), synchronous and in the background; and what resuming costs, at the same and at another
world size. One run, one machine, the same job for every side.

The job: examples/gpt with a model of --n-embd/--n-layer (default 512 x 8, 25 M parameters:
100 MB of float32, 300 MB with AdamW's two moments), ZeRO stage 2 on --workers workers, a save
every --save-steps steps. From each run's metrics.jsonl: the median step time of the steps that
did not save, and for every save the stall (the step's time spent on it: for a background save,
the snapshot copied to memory and the hand-over; the slowest of rank 0's saves is reported) and
the time until the checkpoint was complete on disk. Then each side's last checkpoint is resumed
by a 1-step run on the same number of workers and on --resume-workers, timing the read.

With a PyTorch 2.x python (--torch2-python; skipped when absent) the same GPT is trained by
bench/torch_gpt.py with FSDP2 and saved with torch.distributed.checkpoint, dcp.save and
dcp.async_save (each rank writes its own part, as lockstep's sharded format), and resumed on the
same world sizes (DCP reshards on load), timed the same way: the stall is the time the training
loop waited in the save call, "complete" when the write had finished.

    /usr/bin/python3 bench/compare_checkpoint.py [--build build] [--workers 2] [--resume-workers 1,3]
        [--steps 12] [--save-steps 4] [--n-embd 512] [--n-layer 8] [--repeat 5] [--out bench/CHECKPOINT.md]
        [--torch2-python ~/.cache/lockstep/venv-torch-2.15.0/bin/python]
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import compare_ddp  # noqa: E402
from compare_gpt import json_line  # noqa: E402

DCP_SIDES = {  # PyTorch 2.x: FSDP2 and torch.distributed.checkpoint
    "DCP async_save (PyTorch 2.x, FSDP2)": ["--async-save"],
    "DCP save (PyTorch 2.x, FSDP2)": [],
}
SIDES = {
    "consolidated": ["--save-format", "consolidated"],
    "sharded, background": ["--save-format", "sharded"],
    "sharded, synchronous": ["--save-format", "sharded", "--save-in-background=false"],
}


def cpu():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def events(path, kind):
    out = []
    for line in open(path):
        line = line.strip()
        if line:
            j = json.loads(line)
            if j.get("event") == kind:
                out.append(j)
    return out


def gpt(args, workers, out, extra):
    argv = [f"{args.build}/tools/lockstep", "run", "--nproc-per-node", str(workers), f"{args.build}/examples/gpt",
            "--n-embd", str(args.n_embd), "--n-layer", str(args.n_layer), "--n-head", "8",
            "--per-device-train-batch-size", str(args.batch), "--zero-stage", "2", "--output-dir", out,
            "--disable-tqdm", "--eval-strategy", "no", "--logging-steps", "1", "--train-limit", "4000",
            "--eval-limit", "8"] + extra
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    p = subprocess.run(argv, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(argv)}\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return p.stdout


def torch_gpt(args, workers, extra):
    """bench/torch_gpt.py with FSDP2 on `workers` workers under lockstep run; its JSON line."""
    argv = [f"{args.build}/tools/lockstep", "run", "--nproc-per-node", str(workers), args.torch2_python,
            os.path.join(HERE, "torch_gpt.py"), "--fsdp2", "--n-embd", str(args.n_embd), "--n-layer", str(args.n_layer),
            "--n-head", "8", "--batch", str(args.batch), "--train-limit", "4000", "--eval-limit", "8",
            "--warmup", "0"] + extra
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    p = subprocess.run(argv, capture_output=True, text=True, env=env)
    result = json_line(p.stdout)
    if p.returncode != 0 or result is None:
        raise SystemExit(f"failed ({p.returncode}): {' '.join(argv)}\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    return result


def directory_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def dcp_saves(args, tmp, rows, last):
    for side, flags in DCP_SIDES.items():
        out = os.path.join(tmp, "dcp-async" if flags else "dcp-sync")
        got = torch_gpt(args, args.workers, flags + ["--max-steps", str(args.steps), "--save-steps",
                                                     str(args.save_steps), "--save-dir", out])
        saves = got["saves"]
        rows.append((side, got["plain_step_s_median"], max(c["stall_s"] for c in saves),
                     statistics.median(c["complete_s"] for c in saves), directory_bytes(saves[-1]["path"])))
        print(rows[-1], flush=True)
        last[side] = saves[-1]["path"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--resume-workers", default="1,3")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--save-steps", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=512)
    ap.add_argument("--n-layer", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5, help="resumes of each checkpoint on each world size")
    ap.add_argument("--out", default=os.path.join(HERE, "CHECKPOINT.md"))
    ap.add_argument("--json", help="also write every figure here (bench/run-headline reads it)")
    ap.add_argument("--torch2-python", default=os.path.expanduser("~/.cache/lockstep/venv-torch-2.15.0/bin/python"),
                    help="a python with PyTorch 2.x for the DCP sides (skipped when it does not exist)")
    args = ap.parse_args()
    with_dcp = os.path.exists(args.torch2_python)
    rows, last = [], {}
    with tempfile.TemporaryDirectory(prefix="lockstep-checkpoint-bench-", dir="/var/tmp") as tmp:
        for side, flags in SIDES.items():
            out = os.path.join(tmp, side.replace(", ", "-"))
            gpt(args, args.workers, out, flags + ["--max-steps", str(args.steps), "--save-strategy", "steps",
                                                   "--save-steps", str(args.save_steps)])
            metrics = os.path.join(out, "metrics.jsonl")
            saves = [c for c in events(metrics, "checkpoint") if c["action"] == "save"]
            saved_steps = {c["step"] for c in saves}
            steps = [l["step_seconds"] for l in events(metrics, "log") if l["step"] not in saved_steps]
            step = statistics.median(steps)
            rows.append((side, step, max(c["stall_seconds"] for c in saves),
                         statistics.median(c["write_seconds"] for c in saves), saves[-1]["bytes"]))
            print(rows[-1], flush=True)
            last[side] = saves[-1]["dir"]
        if with_dcp:
            dcp_saves(args, tmp, rows, last)
        # Every side's resumes interleaved, --repeat rounds, the median kept: the host's noise
        # then falls on all sides alike.
        reads = {}
        for r in range(args.repeat):
            for side, flags in SIDES.items():
                for workers in [args.workers] + [int(w) for w in args.resume_workers.split(",") if w]:
                    again = os.path.join(tmp, f"resume-{side.replace(', ', '-')}-{workers}-{r}")
                    gpt(args, workers, again, flags + ["--max-steps", str(args.steps + 1), "--save-strategy", "no",
                                                       "--resume-from-checkpoint", last[side]])
                    read = events(os.path.join(again, "metrics.jsonl"), "checkpoint")[0]
                    reads.setdefault((side, workers), []).append(read["stall_seconds"])
                    print(side, workers, read["stall_seconds"], flush=True)
            for side in DCP_SIDES if with_dcp else []:
                for workers in [args.workers] + [int(w) for w in args.resume_workers.split(",") if w]:
                    got = torch_gpt(args, workers, ["--max-steps", "1", "--resume-from", last[side]])
                    reads.setdefault((side, workers), []).append(got["load_s"])
                    print(side, workers, got["load_s"], flush=True)
        loads = [(side, workers, statistics.median(t)) for (side, workers), t in reads.items()]
    blas = os.path.realpath("/etc/alternatives/libblas.so.3-x86_64-linux-gnu")
    lines = ["# Checkpoints: consolidated against sharded, synchronous and in the background", "",
             f"{datetime.date.today()}, {cpu()}, {os.cpu_count()} cores, commit "
             f"{subprocess.run(['git', '-C', ROOT, 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}; "
             f"the GPT at {args.n_embd} wide x {args.n_layer} layers, ZeRO stage 2 on {args.workers} workers, "
             f"batch {args.batch} x 128 bytes, one intra-op and one BLAS thread each (BLAS: {blas}); checkpoints "
             f"on /var/tmp ({subprocess.run(['df', '--output=source,fstype', '/var/tmp'], capture_output=True, text=True).stdout.split()[-1]}). "
             f"PyTorch 2.x: {compare_ddp.torch_build(args.torch2_python if with_dcp else None)}, "
             f"FSDP2 (ZeRO-3's sharding) on gloo, launched by lockstep run.",
             f"Command: `/usr/bin/python3 bench/compare_checkpoint.py {' '.join(sys.argv[1:])}`", "",
             "| save | step without a save (median) | stall of the slowest save | stall / step | "
             "checkpoint complete after (median) | checkpoint size |", "|---|---|---|---|---|---|"]
    for side, step, stall, write, size in rows:
        lines.append(f"| {side} | {step * 1e3:.0f} ms | {stall * 1e3:.0f} ms | {(step + stall) / step:.2f}x | "
                     f"{write * 1e3:.0f} ms | {size / 1e6:.0f} MB |")
    lines += ["", f"| checkpoint | resumed on | read (model and optimizer state, every rank; median of {args.repeat}) |",
              "|---|---|---|"]
    for side, workers, seconds in loads:
        lines.append(f"| {side} | {workers} worker{'s' if workers > 1 else ''} | {seconds * 1e3:.0f} ms |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"saves": {side: {"step_s": step, "stall_s": stall, "write_s": write, "bytes": size}
                                 for side, step, stall, write, size in rows},
                       "reads": [{"side": side, "workers": workers, "read_s": seconds} for side, workers, seconds in loads]},
                      f, indent=1)


if __name__ == "__main__":
    main()
