#!/usr/bin/python3
"""DeepSpeed's pipeline parallelism (PipelineModule and its engine) on bench/torch_gpt.py's GPT, the
peer of `examples/gpt --pipeline-parallel P` in bench/compare_pipeline.py. The embedding and the head
share one weight through TiedLayerSpec, as lockstep's stages tie theirs. DeepSpeed's pipeline
schedule is its own 1F1B-like TrainSchedule. The last rank prints one JSON line.

    lockstep run --nproc-per-node 2 PEERS_PYTHON bench/deepspeed_pipeline.py --microbatches 8
        [--micro-batch 2] [--steps 30] [--warmup 10] [--n-layer 4 --n-head 4 --n-embd 256 --block-size 128]

PEERS_PYTHON: the python of the venv bench/peers/setup makes (DeepSpeed beside the pinned torch).
"""
import json
import os
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_gpt  # noqa: E402
import torch_pipeline  # noqa: E402


class Embedding(torch.nn.Module):
    def __init__(self, vocab, block_size, n_embd):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, n_embd)
        self.wpe = torch.nn.Embedding(block_size, n_embd)
        torch.nn.init.normal_(self.wte.weight, 0.0, 0.02)
        torch.nn.init.normal_(self.wpe.weight, 0.0, 0.02)

    def forward(self, idx):
        return self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))


class FinalNorm(torch.nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.ln_f = torch.nn.LayerNorm(n_embd)

    def forward(self, x):
        return self.ln_f(x)


def head(embedding, x):
    return F.linear(x, embedding.wte.weight)


def main():
    args = torch_pipeline.peer_arguments().parse_args()
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    torch.manual_seed(42)
    world = torch.distributed.get_world_size()
    c = args.n_embd
    layers = [TiedLayerSpec("embedding", Embedding, torch_gpt.VOCAB, args.block_size, c, tied_weight_attr="wte.weight")]
    layers += [LayerSpec(torch_gpt.Block, c, args.n_head, 0.0, 0.0) for _ in range(args.n_layer)]
    layers += [LayerSpec(FinalNorm, c),
               TiedLayerSpec("embedding", Embedding, torch_gpt.VOCAB, args.block_size, c, forward_fn=head,
                             tied_weight_attr="wte.weight")]

    def loss_fn(logits, target):
        return F.cross_entropy(logits.float().reshape(-1, torch_gpt.VOCAB), target.reshape(-1))

    model = PipelineModule(layers=layers, num_stages=world, loss_fn=loss_fn,
                           partition_method="type:Block")  # the blocks evenly, as the other sides cut them
    config = {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.microbatches,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.99], "weight_decay": 0.1,
                                                        "torch_adam": True}},
              "gradient_clipping": 0.0, "steps_per_print": 10 ** 9}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    _, train_stream, _ = torch_gpt.load_corpus(args.corpus_dir)
    data = torch_gpt.TokenBlocks(train_stream, args.block_size)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(42)).tolist()

    def batches():
        i = 0
        while True:
            block = torch.stack([data[order[(i + j) % len(order)]] for j in range(args.micro_batch)])
            i += args.micro_batch
            yield block[:, :-1], block[:, 1:]

    it = batches()
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        begin = time.perf_counter()
        loss = engine.train_batch(data_iter=it)
        torch.distributed.barrier()
        if step >= args.warmup:
            times.append(time.perf_counter() - begin)
        losses.append(float(loss))
    if torch.distributed.get_rank() == world - 1:
        step_s = sum(times) / len(times)
        tokens = args.microbatches * args.micro_batch * args.block_size
        print(json.dumps({"side": "deepspeed", "deepspeed": deepspeed.__version__, "stages": world, "parts": [int(b) for b in model.parts],
                          "microbatches": args.microbatches, "step_s": step_s, "tokens_per_s": tokens / step_s,
                          "first_loss": losses[0], "last_loss": losses[-1]}))


if __name__ == "__main__":
    main()
