#!/usr/bin/python3
"""What gradient compression between machines costs in accuracy: the same training, exact and
compressed, on two machines (network namespaces, one worker each, so every gradient crosses the
link and goes through the codec), in one run.

  CNN   the demo's Fashion-MNIST CNN (examples/fashion_mnist, 5 epochs, 2 workers of 64, as
        ./scripts/demo trains it): test accuracy on the 10,000 test images.
  GPT   examples/gpt on the fortune corpus, --gpt-steps steps of 2 workers x 16 x 128 bytes:
        validation loss (nats/byte) on --gpt-eval-limit blocks.

Each --hooks entry is a --ddp-comm-hook value, optionally with a PowerSGD rank and rounds:
powersgd:4:2 is rank 4, two exchanges per step (the paper's), powersgd:4:6 three power iterations
per step (six exchanges), powersgd:4:1 alternates sides (one exchange). Or local SGD with exact gradients: sync:K meets every K steps by averaging the
models (--sync-every K), diloco:K with DiLoCo's outer step (lr 0.7, Nesterov momentum 0.9).
Needs root (namespaces).

    sudo /usr/bin/python3 bench/compare_compression.py [--build build] [--rate 10gbit]
        [--hooks none,powersgd:4:2,powersgd:4:1,int8] [--parts cnn,gpt] [--gpt-steps 300]
        [--gpt-hook-start-step 10]
        [--out bench/COMPRESSION.md]
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from compare_cluster import Cluster, PORT, cpu, sh  # noqa: E402


def run_job(cluster, build, program, timeout=3600):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", LOCKSTEP_TOKEN="bench-token")
    procs = []
    for m in range(cluster.n):
        argv = [f"{build}/tools/lockstep", "run", "--nnodes", str(cluster.n), "--node-rank", str(m),
                "--nproc-per-node", "1", "--master-addr", cluster.address(0), "--master-port", str(PORT)]
        procs.append(subprocess.Popen(cluster.on(m, argv + program), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env))
    outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    for p, out in zip(procs, outputs):
        if p.returncode != 0:
            raise SystemExit(f"failed ({p.returncode}): {' '.join(program)}\n{out[-3000:]}")
    return outputs[0]


def hook_flags(hook):
    name, *rest = hook.split(":")
    if name == "sync":
        return ["--sync-every", rest[0]]
    if name == "diloco":
        return ["--sync-every", rest[0], "--outer-learning-rate", "0.7", "--outer-momentum", "0.9"]
    flags = ["--ddp-comm-hook", name]
    if rest:
        flags += ["--powersgd-rank", rest[0]]
    if len(rest) > 1:
        flags += ["--powersgd-rounds", rest[1]]
    return flags


def cnn(cluster, build, hook, out):
    run_job(cluster, build, [f"{build}/examples/fashion_mnist", "--model", "cnn", "--output-dir", out,
                             "--disable-tqdm", "--save-strategy", "no"] + hook_flags(hook))
    r = json.load(open(os.path.join(out, "eval_results.json")))
    return r["eval_accuracy"], r["train_seconds"]


def gpt(cluster, build, hook, out, steps, eval_limit, start_step):
    run_job(cluster, build, [f"{build}/examples/gpt", "--max-steps", str(steps), "--output-dir", out,
                             "--disable-tqdm", "--save-strategy", "no", "--eval-strategy", "no",
                             "--eval-limit", str(eval_limit), "--comm-hook-start-step", str(start_step)] +
            hook_flags(hook))
    r = json.load(open(os.path.join(out, "eval_results.json")))
    return r["eval_loss"], r["train_seconds"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--rate", default="10gbit")
    ap.add_argument("--hooks", default="none,powersgd:4:2,powersgd:4:1,int8")
    ap.add_argument("--parts", default="cnn,gpt")
    ap.add_argument("--gpt-steps", type=int, default=300)
    ap.add_argument("--gpt-eval-limit", type=int, default=200)
    ap.add_argument("--gpt-hook-start-step", type=int, default=10,
                    help="GPT steps with exact gradients before the codec starts (PyTorch's start_powerSGD_iter)")
    ap.add_argument("--out", default=os.path.join(HERE, "COMPRESSION.md"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("compare_compression.py makes network namespaces: run it as root")
    hooks = args.hooks.split(",")
    lines = ["# Gradient compression between machines: accuracy against exact gradients", "",
             f"{datetime.date.today()}, {cpu()}, {os.cpu_count()} cores shared by both machines, commit "
             f"{sh('git', '-C', ROOT, 'rev-parse', '--short', 'HEAD').strip()}; 2 machines (network namespaces, "
             f"{args.rate}) x 1 worker, one intra-op and one BLAS thread each (BLAS: "
             f"{os.path.realpath('/etc/alternatives/libblas.so.3-x86_64-linux-gnu')}). The first 10 steps (the "
             f"GPT's first {args.gpt_hook_start_step}) are exact in every compressed run (--comm-hook-start-step).",
             f"Command: `sudo /usr/bin/python3 bench/compare_compression.py {' '.join(sys.argv[1:])}`", ""]
    cluster = Cluster(2, args.rate)
    try:
        with tempfile.TemporaryDirectory(prefix="lockstep-compression-") as tmp:
            if "cnn" in args.parts:
                lines += ["| CNN, 5 epochs, 2 x 64 | test accuracy | vs exact | training s |", "|---|---|---|---|"]
                exact = None
                for hook in hooks:
                    acc, secs = cnn(cluster, args.build, hook, os.path.join(tmp, "cnn-" + hook.replace(":", "-")))
                    exact = acc if exact is None and hook == "none" else exact
                    lines.append(f"| {hook} | {acc:.4f} | {acc - exact if exact is not None else 0:+.4f} | {secs:.0f} |")
                    print(lines[-1], flush=True)
                lines.append("")
            if "gpt" in args.parts:
                lines += [f"| GPT, {args.gpt_steps} steps, 2 x 16 x 128 bytes | validation loss | vs exact | training s |",
                          "|---|---|---|---|"]
                exact = None
                for hook in hooks:
                    loss, secs = gpt(cluster, args.build, hook, os.path.join(tmp, "gpt-" + hook.replace(":", "-")),
                                     args.gpt_steps, args.gpt_eval_limit, args.gpt_hook_start_step)
                    exact = loss if exact is None and hook == "none" else exact
                    rel = f"{(loss / exact - 1) * 100:+.2f}%" if exact else ""
                    lines.append(f"| {hook} | {loss:.4f} | {rel} | {secs:.0f} |")
                    print(lines[-1], flush=True)
                lines.append("")
    finally:
        cluster.close()
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
