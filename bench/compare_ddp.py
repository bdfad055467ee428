#!/usr/bin/python3
"""DDP training throughput, lockstep against PyTorch, in one run on this machine.

For each model (mlp 784-1024-1024-10, wide 784-2048x3-10, cnn: the example's CNN), per-worker batch 64, one intra-op
thread and one BLAS thread per worker, it runs interleaved, --repeat times:
  lockstep 1 process (no DDP)           build/bench/ddp_bench
  lockstep DDP, 2 workers               lockstep run --nproc-per-node 2 ddp_bench (buckets in shared memory)
  lockstep DDP, 2 workers, private      ... --private-buckets (staged copies: the path before zero-copy)
  lockstep DDP, 2 workers, bf16 wire    ... --comm-hook bf16
  lockstep 2 workers under no_sync      (no communication: the ceiling)
  PyTorch 1 process                     /usr/bin/python3 bench/torch_ddp.py
  PyTorch DDP (gloo), 2 workers         lockstep run --nproc-per-node 2 python3 torch_ddp.py
  PyTorch 2 workers under no_sync       ... --no-sync
  PyTorch 2.x: 1 process, DDP (gloo), DDP of torch.compile(model), no_sync: the same script on the
                                        torch 2.x venv's python (--torch2-python; skipped when absent)
and prints a markdown table of median samples/s (and range), scaling efficiency (2-worker
throughput over twice the same side's single process), the share of the same side's no_sync
ceiling, the exposed-communication fraction of the step, and lockstep DDP over PyTorch DDP.

Every side runs with the glibc malloc tunables `lockstep run` gives its workers (freed memory is
kept for reuse, not unmapped and faulted in again each step), single processes included.

Both sides multiply through the same libblas.so.3. When OpenBLAS picks kernels below what the
CPU runs (Debian 12's 0.3.21 on CPU models it does not know), both sides get OPENBLAS_CORETYPE
set to the CPU's best (--blas-kernels best, the default) or keep OpenBLAS's own choice
(--blas-kernels as-detected); the header says which ran.

    /usr/bin/python3 bench/compare_ddp.py [--build build] [--repeat 3] [--models mlp,wide]
                                          [--blas-kernels best|as-detected] [--json out.json]
                                          [--torch2-python ~/.cache/lockstep/venv-torch-2.15.0/bin/python]

The pip wheel of torch 2.x multiplies with its own BLAS (MKL on x86), not libblas.so.3: the header
names each side's.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = {"mlp": 300, "wide": 100, "cnn": 100}


def run(cmd, env):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    for line in out.stdout.splitlines():
        line = line.split("] ", 1)[-1] if line.startswith("[rank") else line
        if line.startswith("{"):
            return json.loads(line)
    raise SystemExit(f"failed ({out.returncode}): {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")


def blas():
    try:
        return os.path.realpath("/etc/alternatives/libblas.so.3-x86_64-linux-gnu")
    except OSError:
        return "unknown"


def cpu_name():
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def torch_build(python):
    """The torch version and BLAS of `python` (None: not measured)."""
    if not python:
        return "not measured (no --torch2-python)"
    code = ("import torch; c = torch.__config__.show(); "
            "b = [p.split('=')[1] for p in c.replace(chr(10), ',').split(',') if 'BLAS_INFO=' in p]; "
            "print('torch', torch.__version__, 'BLAS', b[0] if b else '?')")
    return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()


def best_openblas_core():
    """The widest OpenBLAS kernel set this CPU runs (the rules of src/train/blas.cc)."""
    flags = set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return "Sandybridge" if "avx" in flags else ""


LEVEL = {"prescott": 0, "core2": 0, "penryn": 0, "dunnington": 0, "nehalem": 0, "atom": 0, "sandybridge": 1,
         "haswell": 2, "zen": 2, "skylakex": 3, "cooperlake": 3, "sapphirerapids": 3}


def openblas_core(bench, env):
    """The kernels OpenBLAS picks by itself here (it prints them with OPENBLAS_VERBOSE=2)."""
    env = {k: v for k, v in env.items() if k != "OPENBLAS_CORETYPE"}
    env["OPENBLAS_VERBOSE"] = "2"
    out = subprocess.run([bench, "--steps", "1", "--warmup", "0"], capture_output=True, text=True, env=env)
    for line in out.stderr.splitlines():
        if line.startswith("Core:"):
            return line.split(":", 1)[1].strip()
    return ""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(HERE, "..", "build"))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--models", default="mlp,wide")
    ap.add_argument("--blas-kernels", choices=["best", "as-detected"], default="best")
    ap.add_argument("--json", help="also write every measurement here")
    ap.add_argument("--torch2-python", default=os.path.expanduser("~/.cache/lockstep/venv-torch-2.15.0/bin/python"),
                    help="a python with torch 2.x for the 2.x columns (none: skip them)")
    args = ap.parse_args()
    build = os.path.abspath(args.build)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    # What lockstep run gives its workers (src/launch/launcher.cc), given to every side here,
    # single processes included, so no side is measured with per-step page faults and another without.
    env.setdefault("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=268435456:glibc.malloc.trim_threshold=1073741824")
    lockstep = os.path.join(build, "tools", "lockstep")
    bench = os.path.join(build, "bench", "ddp_bench")
    detected, best = openblas_core(bench, env), best_openblas_core()
    if "OPENBLAS_CORETYPE" in env:
        kernels = f"OpenBLAS kernels: OPENBLAS_CORETYPE={env['OPENBLAS_CORETYPE']} (set by the caller)"
    elif not detected:
        kernels = "BLAS: not OpenBLAS"
    elif args.blas_kernels == "best" and LEVEL.get(detected.lower(), 9) < LEVEL.get(best.lower(), -1):
        env["OPENBLAS_CORETYPE"] = best
        kernels = (f"OpenBLAS kernels: {best} on both sides (OPENBLAS_CORETYPE={best}; by itself OpenBLAS "
                   f"picks {detected} on this CPU)")
    else:
        kernels = f"OpenBLAS kernels: {detected}, as OpenBLAS picked them"
    peer = ["/usr/bin/python3", os.path.join(HERE, "torch_ddp.py")]
    two = [lockstep, "run", "--nproc-per-node", "2"]

    results = {}
    for model in args.models.split(","):
        common = ["--model", model, "--steps", str(STEPS[model])]
        sides = {
            "lockstep 1 process": [bench] + common,
            "lockstep DDP 2 workers": two + [bench] + common,
            "lockstep DDP 2 workers, private buckets": two + [bench] + common + ["--private-buckets"],
            "lockstep DDP 2 workers, bf16 wire": two + [bench] + common + ["--comm-hook", "bf16"],
            "lockstep 2 workers, no_sync": two + [bench] + common + ["--no-sync"],
            "PyTorch 1 process": peer + common,
            "PyTorch DDP 2 workers (gloo)": two + peer + common,
            "PyTorch 2 workers, no_sync": two + peer + common + ["--no-sync"],
        }
        if os.path.exists(args.torch2_python):
            peer2 = [args.torch2_python, os.path.join(HERE, "torch_ddp.py")]
            sides.update({
                "PyTorch2 1 process": peer2 + common,
                "PyTorch2 DDP 2 workers (gloo)": two + peer2 + common,
                "PyTorch2 DDP 2 workers (gloo), torch.compile": two + peer2 + common + ["--compile"],
                "PyTorch2 2 workers, no_sync": two + peer2 + common + ["--no-sync"],
            })
        got = {k: [] for k in sides}
        for _ in range(args.repeat):
            for name, cmd in sides.items():
                got[name].append(run(cmd, env))
        results[model] = got

    torches = sorted({f"{r['torch']} (BLAS {r['torch_blas']})" for got in results.values() for name, v in got.items()
                      if name.startswith("PyTorch") for r in v})
    print(f"DDP training throughput, per-worker batch 64, 1 intra-op + 1 BLAS thread per worker, "
          f"median of {args.repeat} interleaved runs; {os.cpu_count()} cores, {platform.machine()} ({cpu_name()}), "
          f"lockstep's BLAS {blas()}; {kernels}; PyTorch: {', '.join(torches)}; "
          f"GLIBC_TUNABLES={env['GLIBC_TUNABLES']} on every side\n")
    print("| model | side | samples/s (range) | scaling eff. | of no_sync | exposed comm / step | vs PyTorch 1.13 DDP "
          "| vs PyTorch 2.x DDP |")
    print("|---|---|---|---|---|---|---|---|")
    for model, got in results.items():
        med = {k: statistics.median(r["samples_per_s"] for r in v) for k, v in got.items()}
        single = {side: med[f"{side} 1 process"] for side in ("lockstep", "PyTorch", "PyTorch2") if
                  f"{side} 1 process" in med}
        ceiling = {side: med[f"{side} 2 workers, no_sync"] for side in single}
        for name, runs in got.items():
            rates = [r["samples_per_s"] for r in runs]
            world = runs[0]["world"]
            side = name.split()[0]
            eff = f"{med[name] / (world * single[side]):.0%}" if world > 1 else ""
            of_ceiling = f"{med[name] / ceiling[side]:.0%}" if "DDP" in name else ""
            exposed = ""
            if "exposed_comm_s" in runs[0] and world > 1 and not runs[0].get("no_sync"):
                exposed = f"{statistics.median(r['exposed_comm_s'] / r['step_s'] for r in runs):.0%}"
            ratio = f"{med[name] / med['PyTorch DDP 2 workers (gloo)']:.2f}x" if "DDP" in name else ""
            peer2 = med.get("PyTorch2 DDP 2 workers (gloo)")
            ratio2 = f"{med[name] / peer2:.2f}x" if "DDP" in name and peer2 else ""
            print(f"| {model} | {name} | {med[name]:.0f} ({min(rates):.0f}-{max(rates):.0f}) | {eff} | "
                  f"{of_ceiling} | {exposed} | {ratio} | {ratio2} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
