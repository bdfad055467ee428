#!/usr/bin/python3
"""Hugging Face GPT-2 and lockstep's C++ GPT, both ways (models/hf_gpt2.h).

A GPT2LMHeadModel made by transformers from a config (no hub is reachable; byte tokens, so the
fortune corpus trains it) and written by save_pretrained loads into the C++ GPT, whose logits equal
transformers' within 1e-5 (float32 sums in another order: measured up to ~1e-6), for both GELU forms
and for a model saved in shards. Then the C++ example fine-tunes it with `lockstep run` on 2 workers
and writes it back with `gpt export-hf`: from_pretrained loads it (the weights moved away from the
start), its logits again equal the C++ model's, and greedy generation gives the same tokens in both (three prompts, 40 tokens each).
Greedy decoding takes the larger of two logits, so where two are within the implementations'
rounding (1e-5) the two may pick differently; the test accepts a divergence only there.
"""
import os
import subprocess
import unittest

import harness

harness.require_hugging_face()
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

TOLERANCE = 1e-5
PROMPTS = (b"The ", b"%\nA man ", b"Q:")
STEPS = "200"  # enough for the model to continue a prompt with words, not one repeated byte


def tiny_gpt2(activation="gelu_new", seed=0):
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                        activation_function=activation, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).eval()


class Gpt2Interop(harness.TestCase):
    def binary(self, *parts):
        return os.path.join(harness.build_dir(), *parts)

    def run_ok(self, argv, timeout=300):
        done = subprocess.run(argv, capture_output=True, timeout=timeout, env=harness.base_env())
        self.assertEqual(done.returncode, 0, done.stdout.decode(errors="replace") + done.stderr.decode(errors="replace"))
        return done.stdout

    def cpp_logits(self, model_dir, tokens):
        work = self.tmpdir(prefix="gpt2_logits_")
        save_file({"tokens": tokens.contiguous()}, os.path.join(work, "tokens.safetensors"))
        out = os.path.join(work, "logits.safetensors")
        self.run_ok([self.binary("tests", "models", "hf_gpt2_logits"), model_dir,
                     os.path.join(work, "tokens.safetensors"), out])
        return load_file(out)["logits"]

    def assert_same_logits(self, model, model_dir, what):
        tokens = torch.randint(256, (4, model.config.n_positions), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = model(tokens).logits
        got = self.cpp_logits(model_dir, tokens)
        self.assertEqual(got.shape, expected.shape)
        error = (got - expected).abs().max().item()
        print(f"{what}: logits {tuple(got.shape)}, spread {expected.std().item():.3g}, "
              f"largest difference from transformers {error:.3g}", flush=True)
        self.assertLess(error, TOLERANCE, what)

    def test_transformers_logits_for_both_gelus_and_sharded_files(self):
        for activation in ("gelu_new", "gelu"):
            model = tiny_gpt2(activation)
            out = self.tmpdir(prefix="gpt2_")
            model.save_pretrained(out)
            self.assertTrue(os.path.exists(os.path.join(out, "model.safetensors")))
            self.assert_same_logits(model, out, activation)
        sharded = self.tmpdir(prefix="gpt2_sharded_")
        model.save_pretrained(sharded, max_shard_size="100KB")
        self.assertTrue(os.path.exists(os.path.join(sharded, "model.safetensors.index.json")))
        self.assert_same_logits(model, sharded, "sharded")

    def greedy_hf(self, model, prompt, n):
        with torch.no_grad():
            out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0, eos_token_id=None, attention_mask=torch.ones(1, len(prompt),
                                                                                             dtype=torch.long))
        return out[0].tolist()

    def assert_same_greedy(self, model, cpp, hf):
        for i, (a, b) in enumerate(zip(cpp, hf)):
            if a == b:
                continue
            with torch.no_grad():
                logits = model(torch.tensor([hf[:i]])).logits[0, -1]
            gap = abs(logits[a] - logits[b]).item()
            self.assertLess(gap, TOLERANCE, f"token {i}: lockstep chose {a}, transformers {b}, "
                                            f"whose logits are {gap:.3g} apart")
            print(f"greedy: a tie at token {i} ({gap:.3g} apart); compared up to there", flush=True)
            return
        self.assertEqual(len(cpp), len(hf))

    def test_finetuned_with_lockstep_loads_in_transformers_and_generates_the_same(self):
        start = tiny_gpt2()
        source = self.tmpdir(prefix="gpt2_start_")
        start.save_pretrained(source)
        run = self.tmpdir(prefix="gpt2_run_")
        code, output = harness.run_launcher(2, [self.binary("examples", "gpt"), "train", "--from-hf", source,
                                                "--train-limit", "1024", "--eval-limit", "32", "--max-steps", STEPS,
                                                "--save-steps", STEPS, "--eval-steps", STEPS, "--logging-steps", "50",
                                                "--learning-rate", "3e-3",
                                                "--per-device-train-batch-size", "8", "--disable-tqdm",
                                                "--output-dir", run], run, timeout=600)
        self.assertEqual(code, 0, output)
        self.assertIn("from " + source, output)
        checkpoint = os.path.join(run, f"checkpoint-{STEPS}")
        tuned = os.path.join(run, "hf")
        self.run_ok([self.binary("examples", "gpt"), "export-hf", "--checkpoint", checkpoint, "--output", tuned])

        model = GPT2LMHeadModel.from_pretrained(tuned).eval()
        moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), start.parameters()))
        self.assertGreater(moved, 1e-3, "the exported weights are the starting ones: nothing was fine-tuned")
        self.assert_same_logits(model, tuned, "fine-tuned")

        n = 40
        for prompt in PROMPTS:
            hf = self.greedy_hf(model, prompt, n)
            for source_dir in (checkpoint, tuned):  # lockstep's own checkpoint, and the exported directory
                printed = self.run_ok([self.binary("examples", "gpt"), "generate", "--checkpoint", source_dir,
                                       "--prompt-tokens", ",".join(str(b) for b in prompt), "--temperature", "0",
                                       "--max-new-tokens", str(n), "--print-tokens"])
                cpp = [int(t) for t in printed.split()]
                self.assertEqual(cpp[:len(prompt)], list(prompt))
                self.assertEqual(len(cpp), len(prompt) + n)
                self.assert_same_greedy(model, cpp, hf)
            print(f"greedy continuation of {prompt}: {bytes(hf[len(prompt):])}", flush=True)

if __name__ == "__main__":
    unittest.main(verbosity=2)
