#!/usr/bin/python3
"""Sharded data parallelism on 2 workers, lockstep against PyTorch 1.13 and 2.x, in one run on this machine.

For the wide MLP (784-2048x3-10 on Fashion-MNIST, batch 64 per worker) and the GPT (4 layers, 256
wide, batch 16 x 128 bytes per worker), AdamW, clipping at 1, one intra-op and one BLAS thread
per worker, interleaved --repeat times:
  lockstep DDP                    examples/{fashion_mnist,gpt} under lockstep run
  lockstep ZeRO-1, ZeRO-2         ... --zero-stage 1 / 2
  lockstep ZeRO-2, one copy       ... --zero-stage 2 --zero-shared-parameters
  PyTorch DDP (gloo)              bench/torch_zero.py
  PyTorch ZeroRedundancyOptimizer bench/torch_zero.py --zero (ZeRO-1: all-reduce, then broadcast)
  PyTorch 2.x DDP, ZeRO           the same script on the torch 2.x venv's python (--torch2-python;
                                  skipped when absent; the wheel multiplies with its own BLAS, MKL)
  DeepSpeed ZeRO-1, -2, -3        bench/torch_zero.py --deepspeed N in the peers venv that
                                  bench/peers/setup makes (DeepSpeed pinned, on the same torch; CPU
                                  accelerator, gloo, fp32, the same torch AdamW); if it does not
                                  install, its error is printed instead
It prints median throughput (range), the step's optimizer share, rank 0's peak RSS, the job's
memory at the end (all workers' proportional set size summed: shared pages once), and the bytes
of parameters plus optimizer state the job holds (lockstep: what train_begin records for each
worker, times 2; PyTorch: the tensors themselves).

    /usr/bin/python3 bench/compare_zero.py [--build build] [--repeat 3] [--steps 40] [--models wide,gpt]
                                           [--torch2-python PYTHON]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

import compare_ddp
import compare_gpt
import peer_env

HERE = os.path.dirname(os.path.abspath(__file__))
SIDES = {
    "lockstep DDP": [],
    "lockstep ZeRO-1": ["--zero-stage", "1"],
    "lockstep ZeRO-2": ["--zero-stage", "2"],
    "lockstep ZeRO-2, one copy": ["--zero-stage", "2", "--zero-shared-parameters"],
    "PyTorch DDP": [],
    "PyTorch ZeroRedundancyOptimizer": ["--zero"],
}


def lockstep_run(build, model, flags, steps, env):
    program = os.path.join(build, "examples", "gpt" if model == "gpt" else "fashion_mnist")
    model_flags = ["--eval-limit", "32"] if model == "gpt" else ["--model", "wide", "--eval-limit", "200"]
    with tempfile.TemporaryDirectory(prefix="compare-zero-") as out:
        cmd = [os.path.join(build, "tools", "lockstep"), "run", "--nproc-per-node", "2", program, "--output-dir", out,
               "--max-steps", str(steps), "--logging-steps", "10", "--eval-strategy", "no", "--save-strategy", "no",
               "--disable-tqdm"] + model_flags + flags
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
        if done.returncode != 0:
            raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
        metrics = os.path.join(out, "metrics.jsonl")
        logs = compare_gpt.events(metrics, "log")[1:]
        begin = compare_gpt.events(metrics, "train_begin")[-1]
    seconds = sum(e["step_seconds"] for e in logs) / len(logs)
    return {"samples_per_s": statistics.mean(e["samples_per_second"] for e in logs),
            "step_s": seconds, "optimizer_share": statistics.mean(e["optimizer_seconds"] for e in logs) / seconds,
            "peak_rss_bytes": logs[-1]["peak_rss_bytes"], "job_pss_bytes": logs[-1]["job_pss_bytes"],
            "job_state_bytes": 2 * (begin["worker_parameter_bytes"] + begin["worker_optimizer_state_bytes"])}


def pytorch_run(build, model, flags, steps, env, python="/usr/bin/python3"):
    cmd = [os.path.join(build, "tools", "lockstep"), "run", "--nproc-per-node", "2", python,
           os.path.join(HERE, "torch_zero.py"), "--model", model, "--steps", str(steps)] + flags
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    r = compare_gpt.json_line(done.stdout)
    if done.returncode != 0 or r is None:
        raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    state = r["job_parameter_bytes"] and r["job_parameter_bytes"] + r["job_optimizer_state_bytes"]
    return {"samples_per_s": r["samples_per_s"], "step_s": r["step_s"], "optimizer_share": None,
            "peak_rss_bytes": r["peak_rss_bytes"], "job_pss_bytes": r["job_pss_bytes"], "job_state_bytes": state}


def deepspeed_version(python):
    """DeepSpeed's version under `python`, or None when it has none."""
    done = subprocess.run([python, "-c", "import deepspeed; print(deepspeed.__version__)"], capture_output=True,
                          text=True, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="steps per run (the first 10 untimed)")
    ap.add_argument("--models", default="wide,gpt")
    ap.add_argument("--json", help="also write every measurement here")
    ap.add_argument("--torch2-python", default=os.path.expanduser("~/.cache/lockstep/venv-torch-2.15.0/bin/python"),
                    help="a python with torch 2.x for the 2.x rows (none: skip them)")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    sides = dict(SIDES)
    ds_version = None
    if os.path.exists(args.torch2_python):
        sides.update({"PyTorch 2.x DDP": [], "PyTorch 2.x ZeroRedundancyOptimizer": ["--zero"]})
        ds_python, errors = peer_env.peers()  # DeepSpeed, pinned, beside the same torch
        ds_version = ds_python and "deepspeed" not in errors and deepspeed_version(ds_python)
        if ds_version:
            sides.update({f"DeepSpeed ZeRO-{n}": ["--deepspeed", str(n)] for n in (1, 2, 3)})
        else:
            print(f"DeepSpeed: not run: {peer_env.why_not(errors, 'deepspeed')}")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824")
    print(f"ZeRO on 2 workers; {compare_gpt.cpu_model()}, {os.cpu_count()} cores; BLAS {compare_ddp.blas()} "
          f"(PyTorch 2.x: {compare_ddp.torch_build(args.torch2_python if 'PyTorch 2.x DDP' in sides else None)}"
          f"{f', DeepSpeed {ds_version}' if ds_version else ''}); "
          f"1 intra-op + 1 BLAS thread per worker; GLIBC_TUNABLES on every side; median of {args.repeat} interleaved runs\n")
    results = {}
    for model in args.models.split(","):
        got = {name: [] for name in sides}
        for _ in range(args.repeat):
            for name, flags in sides.items():
                if name.startswith("lockstep"):
                    got[name].append(lockstep_run(build, model, flags, args.steps, env))
                else:
                    python = ds_python if "DeepSpeed" in name else args.torch2_python if "2.x" in name else "/usr/bin/python3"
                    got[name].append(pytorch_run(build, model, flags, args.steps, env, python))
        results[model] = got
        print(f"\n### {model}\n")
        print("| side | samples/s (range) | vs lockstep DDP | vs PyTorch 1.13 ZeRO | vs PyTorch 2.x ZeRO | optimizer share "
              "| rank 0 peak RSS | job memory (PSS) | job parameters + optimizer state |")
        print("|---|---|---|---|---|---|---|---|---|")
        med = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in got.items()}
        for name, runs in got.items():
            rates = [r["samples_per_s"] for r in runs]
            shares = [r["optimizer_share"] for r in runs if r["optimizer_share"] is not None]
            share = f"{statistics.median(shares):.0%}" if shares else ""
            zero2 = med.get("PyTorch 2.x ZeroRedundancyOptimizer")
            state = f"{runs[0]['job_state_bytes'] / 2**20:.1f} MiB" if runs[0]["job_state_bytes"] else "not counted"
            print(f"| {name} | {med[name]:.0f} ({min(rates):.0f}-{max(rates):.0f}) | "
                  f"{med[name] / med['lockstep DDP']:.2f}x | {med[name] / med['PyTorch ZeroRedundancyOptimizer']:.2f}x | "
                  f"{f'{med[name] / zero2:.2f}x' if zero2 else ''} | {share} | "
                  f"{statistics.median(r['peak_rss_bytes'] for r in runs) / 2**20:.0f} MiB | "
                  f"{statistics.median(r['job_pss_bytes'] for r in runs) / 2**20:.0f} MiB | "
                  f"{state} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
