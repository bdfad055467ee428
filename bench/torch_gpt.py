#!/usr/bin/python3
"""The PyTorch peer of examples/gpt.cc: the same byte-level GPT on the same fortune corpus, split,
blocks, initialisation, optimiser and learning-rate schedule as the lockstep Trainer, so that the
validation losses (and tokens/s, peak memory) of the two sides can be compared. Runs on Debian's
python3-torch (1.13). Alone it trains one process; under a torchrun-compatible launcher (lockstep
run or torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) it trains with
torch.nn.parallel.DistributedDataParallel over gloo. Rank 0 prints one JSON line on stdout.

    /usr/bin/python3 bench/torch_gpt.py [--max-steps 200] [--batch 16] [--n-layer 4 --n-head 4 --n-embd 256]
        [--block-size 128] [--dropout 0.1] [--attn-dropout P] [--fused-adamw] [--gradient-checkpointing] [--bf16] [--eval-limit N]

On PyTorch 2.x, under a launcher, --fsdp2 shards it with FSDP2 instead of DDP (built on the meta
device, fully_shard per block and at the root, as ZeRO-3), and --save-steps N --save-dir DIR
[--async-save] write torch.distributed.checkpoint checkpoints (dcp.save or dcp.async_save), which
--resume-from DIR reads at any world size; the JSON line then has each save's stall and
completion time and the load's.

What the C++ side does, and this file mirrors:
  data     the category files of /usr/share/games/fortunes (regular files, not the .dat indexes nor
           the .u8 links, by name), entries split on lines holding only "%"; an entry is held out
           for validation when the FNV-1a-64 hash of its bytes is 0 modulo 20; a split's stream is
           its entries, each followed by "\\n%\\n"; block i is stream[i*T : i*T + T + 1].
  model    GPT-2 (pre-LayerNorm, learned positions, exact GELU, head tied to the token embedding),
           weights N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 n_layer)), biases 0.
  training AdamW (betas 0.9/0.99, weight decay on every parameter), linear warm-up over
           ceil(warmup_ratio * max_steps) steps then cosine to 0, gradients clipped to norm 1.
  eval     mean cross-entropy per target byte over the validation blocks, across all ranks.
"""
import argparse
import json
import math
import os
import resource
import stat
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint

VOCAB = 256  # byte-level: every byte value is a token
ENTRY_END = b"\n%\n"  # what follows every entry in a split's stream, as in the fortune files


# ---------------------------------------------------------------------------------------------
# Data: the fortune corpus, read exactly as src/data/text.cc reads it.

def category_files(corpus_dir):
    """The category files: regular files (not symlinks), not hidden, not .dat, not .u8; by name."""
    names = []
    for name in os.listdir(corpus_dir):
        if name.startswith(".") or name.endswith(".dat") or name.endswith(".u8"):
            continue
        if stat.S_ISREG(os.lstat(os.path.join(corpus_dir, name)).st_mode):
            names.append(name)
    if not names:
        sys.exit(f"{corpus_dir} holds no fortune files: install Debian's packages fortunes and fortunes-min")
    return sorted(names)


def read_entries(path):
    """A file's entries, split as std::getline + the C++ loop does: a line "%" closes an entry,
    other lines are joined with "\\n" (a blank line at the start of an entry leaves no trace)."""
    with open(path, "rb") as f:
        data = f.read()
    lines = data.split(b"\n")
    if lines[-1] == b"":  # std::getline yields no empty line after a final newline (nor for an empty file)
        lines.pop()
    entries, entry = [], b""
    for line in lines:
        if line == b"%":
            if entry:
                entries.append(entry)
            entry = b""
            continue
        if entry:
            entry += b"\n"
        entry += line
    if entry:
        entries.append(entry)
    return entries


# FNV-1a-64, the published constants, as src/data/text.cc uses them: both sides must agree.
FNV_OFFSET_BASIS = 14695981039346656037
FNV_PRIME = 1099511628211


def fnv1a64(data):
    h = FNV_OFFSET_BASIS
    for byte in data:
        h = ((h ^ byte) * FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h


def in_validation(entry):
    return fnv1a64(entry) % 20 == 0


class TokenBlocks(torch.utils.data.Dataset):
    """The language-model blocks of one split: item i is the T + 1 bytes stream[i*T : i*T + T + 1]
    (T inputs, T next-byte targets); blocks do not overlap, the remainder is dropped."""

    def __init__(self, stream, block_size, limit=0):
        self.stream = torch.frombuffer(bytearray(stream), dtype=torch.uint8)
        self.block_size = block_size
        self.tokens = len(stream)
        self.blocks = (len(stream) - 1) // block_size if len(stream) > block_size else 0
        self.size = min(self.blocks, limit) if limit > 0 else self.blocks

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        start = i * self.block_size
        return self.stream[start:start + self.block_size + 1].long()


def load_corpus(corpus_dir):
    """(entries, train stream, validation stream)."""
    entries = []
    for name in category_files(corpus_dir):
        entries += read_entries(os.path.join(corpus_dir, name))
    train, valid = bytearray(), bytearray()
    for entry in entries:
        (valid if in_validation(entry) else train).extend(entry + ENTRY_END)
    return entries, bytes(train), bytes(valid)


# ---------------------------------------------------------------------------------------------
# Model: GPT-2, with the parameter names of src/models/gpt.cc.

class CausalSelfAttention(torch.nn.Module):
    def __init__(self, n_embd, n_head, dropout, attn_dropout):
        super().__init__()
        self.n_head = n_head
        self.c_attn = torch.nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = torch.nn.Linear(n_embd, n_embd)
        self.attn_dropout = torch.nn.Dropout(attn_dropout)
        self.resid_dropout = torch.nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        d = c // self.n_head
        # Under --tensor-parallel T, c_attn gives this rank's heads' q, k and v (tensor_parallel_gpt).
        heads = self.n_head // getattr(self, "tensor_parallel", 1)
        q, k, v = (m.view(b, t, heads, d).transpose(1, 2) for m in self.c_attn(x).split(heads * d, dim=2))  # [B, H, T, d]
        dropping = self.training and self.attn_dropout.p > 0
        # Fused where lockstep's GPT fuses (models/gpt.h): on GPUs, and on the CPU in float32 only.
        fused_is_faster = q.is_cuda or q.dtype == torch.float32
        if hasattr(F, "scaled_dot_product_attention") and not dropping and fused_is_faster:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            future = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)  # position i may not see j > i
            y = self.attn_dropout(torch.softmax(att.masked_fill(future, float("-inf")), dim=-1)) @ v
        y = y.transpose(1, 2).contiguous().view(b, t, heads * d)
        return self.resid_dropout(self.c_proj(y))


class Mlp(torch.nn.Module):
    def __init__(self, n_embd, dropout):
        super().__init__()
        self.c_fc = torch.nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = torch.nn.Linear(4 * n_embd, n_embd)
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))  # exact (erf) GELU, as torch::gelu


class Block(torch.nn.Module):
    def __init__(self, n_embd, n_head, dropout, attn_dropout):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout, attn_dropout)
        self.ln_2 = torch.nn.LayerNorm(n_embd)
        self.mlp = Mlp(n_embd, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GptLmHeadModel(torch.nn.Module):
    def __init__(self, config, checkpoint_mode=None):
        super().__init__()
        c, n_layer = config["n_embd"], config["n_layer"]
        self.block_size = config["block_size"]
        # None: no gradient checkpointing; "reentrant" / "non-reentrant": torch.utils.checkpoint's two variants.
        self.checkpoint_mode = checkpoint_mode
        self.transformer = torch.nn.ModuleDict(dict(
            wte=torch.nn.Embedding(config["vocab_size"], c),
            wpe=torch.nn.Embedding(config["block_size"], c),
            drop=torch.nn.Dropout(config["dropout"]),
            h=torch.nn.ModuleList(Block(c, config["n_head"], config["dropout"], config.get("attn_dropout", config["dropout"]))
                                  for _ in range(n_layer)),
            ln_f=torch.nn.LayerNorm(c)))
        self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """GPT-2's initialisation, as the C++ model: in construction order, so one seed gives one
        model. Also what FSDP2 runs once the sharded parameters of a model built on the meta
        device exist."""
        residual_std = 0.02 / math.sqrt(2.0 * len(self.transformer.h))
        for name, module in self.named_modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.normal_(0.0, residual_std if name.endswith("c_proj") else 0.02)
                module.bias.zero_()
            elif isinstance(module, torch.nn.Embedding):
                module.weight.normal_(0.0, 0.02)
            elif isinstance(module, torch.nn.LayerNorm):
                module.reset_parameters()  # weight 1, bias 0

    def forward(self, idx):
        t = idx.size(1)
        if t > self.block_size:
            raise ValueError(f"a sequence of {t} tokens is longer than the context (block_size {self.block_size})")
        tr = self.transformer
        x = tr.drop(tr.wte(idx) + tr.wpe(torch.arange(t, device=idx.device)))
        for block in tr.h:
            if self.checkpoint_mode and self.training:  # recompute the block in backward, as the C++ side
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.checkpoint_mode == "reentrant")
            else:
                x = block(x)
        return F.linear(tr.ln_f(x), tr.wte.weight)  # the head is the token embedding (weight tying)


# ---------------------------------------------------------------------------------------------
# Training: the Hugging Face Trainer's loop, reduced to what the comparison needs.

def lr_multiplier(step, warmup, max_steps):
    """Linear warm-up from 0, then cosine to 0 at max_steps (get_cosine_schedule_with_warmup)."""
    if step < warmup:
        return step / warmup
    progress = (step - warmup) / max(1, max_steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def train_batches(dataset, batch, rank, world, seed):
    """Batches forever, epoch after epoch, each epoch in DistributedSampler's order for this rank."""
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed,
                                                  drop_last=False)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler)
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def profile_steps(train_step, steps, rank):
    """`steps` more steps under the autograd profiler; rank 0 prints where their time went, by
    operator (self time: each op's own, its children's not counted), to stderr."""
    with torch.autograd.profiler.profile() as prof:
        for _ in range(steps):
            train_step()
    if rank == 0:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), file=sys.stderr)


DEVICE = torch.device("cpu")  # --device: cuda is the GPU of this process's LOCAL_RANK


def autocast(bf16):
    return torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=bf16)


def synchronize():
    """Before a clock is read: a GPU's queued work done."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


@torch.no_grad()
def evaluate(model, dataset, batch, rank, world, bf16):
    """Mean cross-entropy per target byte over every block of `dataset`; each rank takes every
    world-th block (no padding, so no block counts twice) and the sums are all-reduced."""
    model.eval()
    mine = torch.utils.data.Subset(dataset, range(rank, len(dataset), world))
    total = torch.zeros(2, dtype=torch.float64, device=DEVICE)  # [sum of losses, number of targets]
    for block in torch.utils.data.DataLoader(mine, batch_size=batch):
        block = block.to(DEVICE)
        x, y = block[:, :-1], block[:, 1:]
        with autocast(bf16):
            logits = model(x)
        total[0] += F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1), reduction="sum").item()
        total[1] += y.numel()
    if world > 1:
        dist.all_reduce(total)
    model.train()
    return (total[0] / total[1]).item()


def step_tensor_bytes(run_step):
    """How much this process's CPU tensors grow within one training step, from its start to its
    peak, as the C++ Trainer's step_tensor_bytes: one step run under the autograd profiler with
    memory tracking, each op's own allocations and frees summed in time order."""
    with torch.autograd.profiler.profile(profile_memory=True, use_kineto=False) as prof:
        run_step()
    now = peak = 0
    for e in sorted(prof.function_events, key=lambda e: e.time_range.start):
        now += e.self_cpu_memory_usage
        peak = max(peak, now)
    return peak


# ---------------------------------------------------------------------------------------------
# PyTorch 2.x only: FSDP2 (ZeRO-3's peer) and DCP checkpoints (the sharded checkpoint's peer).

def tensor_parallel_gpt(model, world):
    """PyTorch 2.x's DTensor tensor parallelism over every rank (one tensor group): in each block
    c_attn and the MLP's c_fc column-wise, both c_proj row-wise (Megatron's plan, as lockstep's
    GPT). c_attn's rows are reordered first so that each rank's slice holds its own heads' q, k and
    v. The embeddings, norms and the tied head stay replicated (lockstep splits the vocabulary too;
    at 256 tokens it is 1% of the 4x model's weights)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    for block in model.transformer.h:
        c = block.attn.c_proj.weight.shape[0]
        order = torch.arange(3 * c).view(3, world, c // world).transpose(0, 1).reshape(-1)
        with torch.no_grad():
            block.attn.c_attn.weight.copy_(block.attn.c_attn.weight[order])
            block.attn.c_attn.bias.copy_(block.attn.c_attn.bias[order])
        block.attn.tensor_parallel = world
        parallelize_module(block, mesh, {"attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
                                         "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})


def clip_tensor_parallel(params, max_norm):
    """The global norm over DTensor shards and replicated tensors alike (torch's clip_grad_norm_
    refuses a mix of the two), and every gradient scaled as clip_grad_norm_ scales it."""
    squares = sum((p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).double().pow(2).sum()
                  for p in params if p.grad is not None)
    coefficient = max_norm / (squares.sqrt().item() + 1e-6)
    if coefficient < 1:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coefficient)


class Optimizers:
    """Several optimizers stepped as one (--tensor-parallel's two AdamWs)."""
    def __init__(self, opts):
        self.opts = opts

    def zero_grad(self, set_to_none=True):
        for o in self.opts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self):
        for o in self.opts:
            o.step()


def fully_shard_gpt(model, reshard_after_forward=True):
    """FSDP2 as its documentation shards a transformer: each block its own unit, then the root
    (embeddings, final LayerNorm, the tied head). Parameters become DTensors sharded on dim 0."""
    from torch.distributed.fsdp import fully_shard
    for block in model.transformer.h:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)


class DcpCheckpoints:
    """Sharded checkpoints with torch.distributed.checkpoint: every rank writes its own part of the
    model's and AdamW's state (dcp.save), or hands a copy in memory to a background thread
    (dcp.async_save, on a gloo group of its own so that its collectives never meet training's).
    Records, per save, the stall (how long the training loop waited) and when it was complete."""

    def __init__(self, model, opt, asynchronous):
        import torch.distributed.checkpoint as dcp
        self.dcp, self.model, self.opt, self.asynchronous = dcp, model, opt, asynchronous
        self.group = dist.new_group(backend="gloo") if asynchronous else None
        self.pending, self.saves = None, []

    def state(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_state, optim_state = get_state_dict(self.model, self.opt)
        return {"model": model_state, "optim": optim_state}

    def save(self, path):
        start = time.perf_counter()
        self.wait()  # one save in flight at a time, as lockstep's background writer
        record = {"path": path}
        if self.asynchronous:
            future = self.dcp.async_save(self.state(), checkpoint_id=path, process_group=self.group)
            future.add_done_callback(lambda _: record.__setitem__("complete_s", time.perf_counter() - start))
            self.pending = future
        else:
            self.dcp.save(self.state(), checkpoint_id=path)
            record["complete_s"] = time.perf_counter() - start
        record["stall_s"] = time.perf_counter() - start
        self.saves.append(record)

    def wait(self):
        if self.pending is not None:
            self.pending.result()
            self.pending = None

    def load(self, path):
        """Reads `path` into the model and optimizer (at any world size: DCP reshards on load);
        returns the seconds it took."""
        from torch.distributed.checkpoint.state_dict import set_state_dict
        start = time.perf_counter()
        state = self.state()
        self.dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return time.perf_counter() - start


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus-dir", default="/usr/share/games/fortunes")
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--fused-adamw", action="store_true",
                    help="torch.optim.AdamW(fused=True) (PyTorch 2.4 and later), as lockstep's Trainer on the CPU")
    ap.add_argument("--attn-dropout", type=float, default=None,
                    help="dropout on the attention probabilities (default: --dropout's); 0 fuses attention on 2.x")
    ap.add_argument("--batch", type=int, default=16, help="per-device training batch")
    ap.add_argument("--eval-batch", type=int, default=32, help="per-device evaluation batch")
    ap.add_argument("--max-steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps at the start")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup-ratio", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--max-grad-norm", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--train-limit", type=int, default=0, help="use only the first N training blocks (0: all)")
    ap.add_argument("--eval-limit", type=int, default=0, help="use only the first N validation blocks (0: all)")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--checkpoint-mode", choices=["reentrant", "non-reentrant"], default="reentrant",
                    help="torch.utils.checkpoint's variant under --gradient-checkpointing")
    ap.add_argument("--bf16", action="store_true", help="autocast forward and loss to bfloat16")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: the GPU of LOCAL_RANK (DDP then over nccl), as lockstep's --device cuda")
    ap.add_argument("--compile", choices=["default", "reduce-overhead", "max-autotune"],
                    help="torch.compile the model in this mode (reduce-overhead: CUDA graphs of forward and backward); "
                         "the optimizer steps eagerly")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="after the timed steps, N more under the autograd profiler: rank 0 prints a table by operator")
    ap.add_argument("--fsdp2", action="store_true", help="torch 2.x: fully_shard each block and the root (ZeRO-3)")
    ap.add_argument("--backend", help="the torch.distributed backend (default: gloo, or nccl with --device cuda); "
                                      "lockstep needs the build's python/ on PYTHONPATH")
    ap.add_argument("--tensor-parallel", action="store_true",
                    help="torch 2.x: DTensor tensor parallelism over every rank (one tensor group, the same batch)")
    ap.add_argument("--save-steps", type=int, default=0, help="a DCP checkpoint every N steps (0: none)")
    ap.add_argument("--save-dir", help="where the DCP checkpoints go: DIR/step-N")
    ap.add_argument("--async-save", action="store_true", help="dcp.async_save instead of dcp.save")
    ap.add_argument("--resume-from", help="a DCP checkpoint to load before training (timed)")
    ap.add_argument("--measure-memory", action="store_true",
                    help="after the timed steps, run one more under the profiler for step_tensor_bytes")
    args = ap.parse_args()
    if args.max_steps < 1:
        sys.exit("--max-steps must be at least 1")
    if args.n_embd % args.n_head:
        sys.exit(f"--n-embd {args.n_embd} is not a multiple of --n-head {args.n_head}")
    if (args.save_steps or args.resume_from) and not args.fsdp2:
        sys.exit("--save-steps and --resume-from write and read DCP checkpoints of FSDP2: add --fsdp2")
    if args.save_steps and not args.save_dir:
        sys.exit("--save-steps needs --save-dir")

    torch.set_num_threads(args.threads)
    global DEVICE
    if args.device == "cuda":
        if args.fsdp2:
            sys.exit("--device cuda with --fsdp2 is not measured here: drop one")
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    rank, world = 0, 1
    if "RANK" in os.environ:
        dist.init_process_group(args.backend or ("nccl" if DEVICE.type == "cuda" else "gloo"))
        rank, world = dist.get_rank(), dist.get_world_size()

    entries, train_stream, valid_stream = load_corpus(args.corpus_dir)
    train_set = TokenBlocks(train_stream, args.block_size, args.train_limit)
    eval_set = TokenBlocks(valid_stream, args.block_size, args.eval_limit)
    if len(train_set) == 0 or len(eval_set) == 0:
        sys.exit(f"too few bytes for one block of {args.block_size} tokens in a split")
    if rank == 0:
        n_valid = sum(1 for e in entries if in_validation(e))
        print(f"corpus: {len(entries)} entries ({len(entries) - n_valid} training, {n_valid} validation); "
              f"training: {train_set.blocks} blocks ({train_set.tokens} bytes), "
              f"validation: {eval_set.blocks} blocks ({eval_set.tokens} bytes); "
              f"using {len(train_set)} training and {len(eval_set)} validation blocks", file=sys.stderr, flush=True)

    config = {"model_type": "gpt", "vocab_size": VOCAB, "block_size": args.block_size, "n_layer": args.n_layer,
              "n_head": args.n_head, "n_embd": args.n_embd, "dropout": args.dropout,
              "attn_dropout": args.dropout if args.attn_dropout is None else args.attn_dropout}
    checkpoint_mode = args.checkpoint_mode if args.gradient_checkpointing else None
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    if args.fsdp2:
        if "RANK" not in os.environ:
            sys.exit("--fsdp2 needs a process group: start under lockstep run or torchrun")
        # As FSDP2's documentation builds a model: on the meta device, sharded, then each rank
        # allocates and initialises only its shards (no whole model in any process).
        with torch.device("meta"):
            model = GptLmHeadModel(config, checkpoint_mode)
        fully_shard_gpt(model)
        model.to_empty(device="cpu")
        model.init_weights()
    else:
        model = GptLmHeadModel(config, checkpoint_mode).to(DEVICE)
    params = sum(p.numel() for p in model.parameters())
    net = model
    # Under --tensor-parallel every rank is one tensor rank of a single replica: the same batches,
    # the same dropout seed (the replicated activations must stay equal), no DDP.
    data_rank, data_world = (0, 1) if args.tensor_parallel else (rank, world)
    if args.tensor_parallel:
        if world < 2:
            sys.exit("--tensor-parallel needs 2 or more ranks: start under lockstep run or torchrun")
        tensor_parallel_gpt(model, world)
    elif world > 1 and not args.fsdp2:
        # Plain DDP (find_unused_parameters=False, no static_graph) is enough for both checkpoint
        # variants in 1.13: every parameter gets exactly one gradient per step, the reentrant one's
        # from its nested backward, and the all-reduced gradients equal those without checkpointing.
        net = torch.nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=25, device_ids=[DEVICE.index] if DEVICE.type == "cuda" else None)
    if args.compile:
        net = torch.compile(net, mode=args.compile)
    torch.manual_seed(args.seed + data_rank)  # each replica's own dropout masks

    # Weight decay on every parameter (one group), as the C++ Trainer.
    # Under --tensor-parallel the DTensor shards and the plain tensors each get their own (fused)
    # AdamW: the fused kernel takes one kind or the other in a call, not both.
    kinds = [list(model.parameters())]
    if args.tensor_parallel:
        kinds = [[p for p in model.parameters() if hasattr(p, "full_tensor")],
                 [p for p in model.parameters() if not hasattr(p, "full_tensor")]]
    opts = [torch.optim.AdamW(kind, lr=args.lr, betas=(0.9, 0.99), eps=1e-8, weight_decay=args.weight_decay,
                              **({"fused": True} if args.fused_adamw else {})) for kind in kinds]
    opt = opts[0] if len(opts) == 1 else Optimizers(opts)
    warmup_steps = math.ceil(args.warmup_ratio * args.max_steps)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: lr_multiplier(s, warmup_steps, args.max_steps))
              for o in opts]
    checkpoints = DcpCheckpoints(model, opt, args.async_save) if args.fsdp2 else None
    load_s = None
    if args.resume_from:
        load_s = torch.tensor([checkpoints.load(args.resume_from)], dtype=torch.float64)
        dist.all_reduce(load_s, op=dist.ReduceOp.MAX)  # the job waits for its slowest rank
        load_s = load_s.item()

    model.train()
    batches = train_batches(train_set, args.batch, data_rank, data_world, args.seed)
    def train_step():
        block = next(batches).to(DEVICE)
        x, y = block[:, :-1], block[:, 1:]
        with autocast(args.bf16):
            logits = net(x)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces the gradients here
        if args.tensor_parallel:
            clip_tensor_parallel(list(model.parameters()), args.max_grad_norm)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        opt.step()
        for sched in scheds:
            sched.step()
        return loss

    timed_steps, start, plain_steps = 0, None, []
    for step in range(args.max_steps):
        if step == min(args.warmup, args.max_steps - 1) and start is None:  # always time at least one step
            synchronize()
            if world > 1:
                dist.barrier()
            start = time.perf_counter()
        step_start = time.perf_counter()
        loss = train_step()
        if args.save_steps and (step + 1) % args.save_steps == 0:
            checkpoints.save(os.path.join(args.save_dir, f"step-{step + 1}"))
        else:
            plain_steps.append(time.perf_counter() - step_start)
        if start is not None:
            timed_steps += 1
    if checkpoints:
        checkpoints.wait()
    if args.profile_steps:
        profile_steps(train_step, args.profile_steps, rank)
    synchronize()
    if world > 1:
        dist.barrier()
    elapsed = time.perf_counter() - start

    eval_loss = evaluate(model, eval_set, args.eval_batch, data_rank, data_world, args.bf16)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kilobytes
    # After the evaluation, so the loss above is after exactly --max-steps steps, and after the
    # RSS reading, which the profiler's own bookkeeping would raise.
    step_bytes = step_tensor_bytes(train_step) if args.measure_memory else None
    rss_max = torch.tensor([rss], dtype=torch.int64, device=DEVICE)  # nccl reduces device tensors only
    if world > 1:
        dist.all_reduce(rss_max, op=dist.ReduceOp.MAX)
    if rank == 0:
        tokens = args.batch * args.block_size * data_world * timed_steps
        print(json.dumps({
            "side": "pytorch", "world": world, "model": config, "params": params, "batch": args.batch,
            "block_size": args.block_size, "steps": args.max_steps, "timed_steps": timed_steps,
            "threads": args.threads, "tokens_per_s": round(tokens / elapsed, 1), "step_s": elapsed / timed_steps,
            "eval_loss": eval_loss, "eval_blocks": len(eval_set), "last_train_loss": loss.item(),
            "peak_rss_bytes": rss, "peak_rss_bytes_max": int(rss_max.item()), "step_tensor_bytes": step_bytes,
            "gradient_checkpointing": args.gradient_checkpointing, "bf16": args.bf16,
            "checkpoint_mode": checkpoint_mode, "fsdp2": args.fsdp2, "tensor_parallel": args.tensor_parallel, "device": str(DEVICE), "compile": args.compile,
            "plain_step_s_median": sorted(plain_steps)[len(plain_steps) // 2] if plain_steps else None,
            "saves": checkpoints.saves if checkpoints else [], "load_s": load_s,
            "torch": torch.__version__}), flush=True)
    if world > 1:
        # Not destroy_process_group(): torch 1.13 can deadlock tearing DDP down (the reducer's gloo
        # group joins a worker thread that waits for the GIL the joining thread holds; seen here,
        # a rank spinning for 13 minutes after its JSON line). The all_reduce above was the last
        # collective of both ranks, so nothing is left to finish.
        os._exit(0)


if __name__ == "__main__":
    main()
