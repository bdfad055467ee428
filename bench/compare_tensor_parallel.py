#!/usr/bin/python3
"""Tensor parallelism on the GPT, lockstep against PyTorch 2.x's DTensor, in one run on this machine.

The 4x GPT (4 layers, 512 wide, 8 heads, 128 bytes of context, dropout 0.1), 2 workers, one
intra-op and one BLAS thread each, per-replica batch 16, interleaved --repeat times; the first 10
steps of every run are not timed.

  lockstep DDP             examples/gpt, 2 data ranks (the same worker count, twice the tokens a step)
  lockstep TP              examples/gpt --tensor-parallel 2 (1 replica split over 2 workers)
  lockstep TP+SP           the same with --sequence-parallel (norms, dropouts, residuals on half the tokens)
  PyTorch DDP (gloo)       bench/torch_gpt.py under DDP
  PyTorch TP (gloo)        bench/torch_gpt.py --tensor-parallel: DTensor's ColwiseParallel /
                           RowwiseParallel on each block (Megatron's plan), on gloo
  PyTorch TP (lockstep)    the same script on lockstep's torch.distributed backend

It prints the median tokens/s of each, lockstep TP (and TP+SP) against PyTorch TP on gloo and
against lockstep DDP, PyTorch TP on the lockstep backend against gloo, and lockstep's memory: each
worker's parameters (its shards under TP; AdamW's state is twice that, so parameters + state scale
alike) and the growth of tensor memory within a step, TP and TP+SP against DDP's at the same
per-replica batch.

    /usr/bin/python3 bench/compare_tensor_parallel.py [--build build] [--torch2-build build-torch2]
        [--repeat 3] [--steps 40] [--json out.json]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

import compare_ddp
import compare_gpt

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = ["--n-embd", "512", "--n-head", "8"]
SIDES = ["lockstep DDP", "lockstep TP", "lockstep TP+SP", "PyTorch DDP (gloo)", "PyTorch TP (gloo)",
         "PyTorch TP (lockstep)"]


def run_lockstep_tp(args, flags, env):
    """compare_gpt.run_lockstep for 2 workers holding one replica: the step's tokens are one batch."""
    with tempfile.TemporaryDirectory(prefix="compare-tp-") as out:
        cmd = [os.path.join(args.build, "tools", "lockstep"), "run", "--nproc-per-node", "2",
               os.path.join(args.build, "examples", "gpt"), "--output-dir", out, "--logging-steps", "10",
               "--eval-strategy", "no", "--save-strategy", "no", "--disable-tqdm", "--tensor-parallel", "2"] + flags
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
        if done.returncode != 0:
            raise SystemExit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
        return compare_gpt.lockstep_result(out, 1)


def run(side, args, env):
    common = ["--max-steps", str(args.steps), "--eval-limit", "32"] + MODEL
    if side == "lockstep DDP":
        return compare_gpt.run_lockstep(args.build, 2, common, env)
    if side.startswith("lockstep TP"):
        return run_lockstep_tp(args, common + (["--sequence-parallel"] if side.endswith("+SP") else []), env)
    flags = common + (["--tensor-parallel"] if "TP" in side else [])
    launcher = args.build
    if "(lockstep)" in side:  # the launcher of the build whose backend is for torch 2.x puts it on the path
        flags += ["--backend", "lockstep"]
        launcher = args.torch2_build
    return compare_gpt.run_pytorch(launcher, 2, flags, env, "pytorch2")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default="build")
    ap.add_argument("--torch2-build", default="build-torch2", help="its python/ holds the backend for torch 2.x")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40, help="steps per run (10 untimed)")
    ap.add_argument("--json", help="also write every measurement here")
    ap.add_argument("--torch2-python", default=os.path.expanduser("~/.cache/lockstep/venv-torch-2.15.0/bin/python"))
    args = ap.parse_args()
    args.build, args.torch2_build = os.path.abspath(args.build), os.path.abspath(args.torch2_build)
    compare_gpt.PYTHONS["pytorch2"] = args.torch2_python
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    env.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824")
    detected = compare_ddp.openblas_core(os.path.join(args.build, "bench", "ddp_bench"), env)
    print(f"The 4x GPT (4 x 512, 8 heads, 128 bytes), 2 workers, per-replica batch 16, 1 intra-op + 1 BLAS thread "
          f"per worker; {compare_ddp.cpu_name()}, {os.cpu_count()} cores; lockstep: {args.build}, BLAS "
          f"{compare_ddp.blas()}, OpenBLAS kernels {detected or 'unknown'}; PyTorch: "
          f"{compare_ddp.torch_build(args.torch2_python)}, AdamW(fused=True)")
    got = {side: [] for side in SIDES}
    for _ in range(args.repeat):
        for side in SIDES:
            got[side].append(run(side, args, env))
    med = {side: statistics.median(r["tokens_per_s"] for r in runs) for side, runs in got.items()}
    print(f"\n### Throughput: tokens/s, median of {args.repeat} interleaved runs (range)\n")
    print("| side | tokens/s | range |")
    print("|---|---|---|")
    for side in SIDES:
        values = [r["tokens_per_s"] for r in got[side]]
        print(f"| {side} | {med[side]:.0f} | {min(values):.0f}-{max(values):.0f} |")
    print(f"\nlockstep TP / PyTorch TP (gloo): {med['lockstep TP'] / med['PyTorch TP (gloo)']:.2f}x; "
          f"lockstep TP / lockstep DDP: {med['lockstep TP'] / med['lockstep DDP']:.2f}x; "
          f"PyTorch TP on lockstep / on gloo: {med['PyTorch TP (lockstep)'] / med['PyTorch TP (gloo)']:.2f}x")
    print(f"lockstep TP+SP / lockstep DDP: {med['lockstep TP+SP'] / med['lockstep DDP']:.2f}x; "
          f"lockstep TP+SP / PyTorch TP (gloo): {med['lockstep TP+SP'] / med['PyTorch TP (gloo)']:.2f}x")
    ddp, tp = got["lockstep DDP"][0], got["lockstep TP"][0]
    grow = {side: statistics.median(r["step_tensor_bytes"] for r in got[side])
            for side in ("lockstep DDP", "lockstep TP", "lockstep TP+SP")}
    print(f"\nlockstep, per worker: parameters {tp['params'] / 1e6:.2f} M under TP against {ddp['params'] / 1e6:.2f} M "
          f"under DDP ({tp['params'] / ddp['params']:.2f}x; AdamW's state follows); tensor growth within a step "
          f"{grow['lockstep TP'] / 2**20:.1f} MiB (TP), {grow['lockstep TP+SP'] / 2**20:.1f} MiB (TP+SP) against "
          f"{grow['lockstep DDP'] / 2**20:.1f} MiB (DDP): {grow['lockstep TP'] / grow['lockstep DDP']:.2f}x and "
          f"{grow['lockstep TP+SP'] / grow['lockstep DDP']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(got, f, indent=1)


if __name__ == "__main__":
    main()
