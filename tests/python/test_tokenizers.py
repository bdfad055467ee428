#!/usr/bin/python3
"""A SentencePiece tokenizer from end to end (torch 2.x leg, which pins Python's sentencepiece):
the Python package trains a BPE model on Debian's fortunes, `gpt prepare-data` (C++, Debian's
libsentencepiece) cuts the same files into a token file, and the file holds exactly the tokens the
Python package gives for them, line by line, with the model's end-of-sentence token after each
fortune (the rule of data/prepare_text.h). Then the GPT trains on that file under `lockstep run`
(2 workers, the vocabulary the tokenizer's) and `gpt generate --tokenizer` continues a prompt: the
text it prints begins with the prompt, decoded from the tokenizer's pieces, not bytes.
"""
import os
import subprocess
import sys
import tempfile
import unittest

import numpy

import harness

FORTUNES = "/usr/share/games/fortunes"
FILES = ["literature", "science", "wisdom"]
VOCABULARY = 800


def require_sentencepiece():
    try:
        import sentencepiece  # noqa: F401
    except ImportError as e:
        required = os.environ.get("LOCKSTEP_REQUIRE_HF") == "1"  # ./scripts/test's venv pins it
        print(f"{'FAIL' if required else 'SKIP'}: {harness.PYTHON} cannot import sentencepiece ({e}); "
              "./scripts/test installs it into its venv (scripts/common.sh)", flush=True)
        sys.exit(1 if required else harness.SKIPPED)


require_sentencepiece()
import sentencepiece  # noqa: E402


def gpt_binary():
    return os.path.join(harness.build_dir(), "examples", "gpt")


def expected_tokens(processor, paths):
    """What prepare_text.h promises: each line's pieces; a "%" line or a file's end closes a
    fortune, and a fortune with tokens is followed by the end-of-sentence token."""
    tokens = []
    for path in paths:
        document = []
        with open(path, encoding="utf-8", errors="surrogateescape", newline="\n") as f:
            lines = f.read().split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the newline that ends the last line starts no line of its own
        for line in lines + ["%"]:
            if line == "%":
                if document:
                    tokens += document + [processor.eos_id()]
                document = []
            else:
                document += processor.encode(line)
    return tokens


class SentencePieceEndToEnd(harness.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.holder = tempfile.TemporaryDirectory(prefix="spm_")
        cls.paths = [os.path.join(FORTUNES, name) for name in FILES]
        cls.model = os.path.join(cls.holder.name, "fortunes")
        sentencepiece.SentencePieceTrainer.train(input=",".join(cls.paths), model_prefix=cls.model,
                                                 vocab_size=VOCABULARY, model_type="bpe", minloglevel=2)
        cls.processor = sentencepiece.SentencePieceProcessor(model_file=cls.model + ".model")

    @classmethod
    def tearDownClass(cls):
        cls.holder.cleanup()

    def prepare(self, out, paths):
        done = subprocess.run([gpt_binary(), "prepare-data", "--tokenizer", self.model + ".model", "--out", out,
                               "--separator", "%", *paths], capture_output=True, text=True, timeout=300,
                              env=harness.base_env())
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        return done.stdout

    def test_prepared_tokens_are_the_python_packages(self):
        out = os.path.join(self.tmpdir(prefix="spm_prepare_"), "train.bin")
        said = self.prepare(out, self.paths)
        ours = numpy.fromfile(out, dtype=numpy.uint16).tolist()
        theirs = expected_tokens(self.processor, self.paths)
        self.assertEqual(len(ours), len(theirs), said)
        self.assertEqual(ours, theirs)
        self.assertIn(f"--vocab-size {VOCABULARY}", said)
        print(f"{len(ours)} tokens, {theirs.count(self.processor.eos_id())} fortunes: {said.strip()}", flush=True)

    def test_the_gpt_trains_on_them_and_generates_text_through_the_tokenizer(self):
        work = self.tmpdir(prefix="spm_gpt_")
        train, val = os.path.join(work, "train.bin"), os.path.join(work, "val.bin")
        self.prepare(train, self.paths[:2])
        self.prepare(val, self.paths[2:])
        argv = [gpt_binary(), "train", "--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32",
                "--train-data", train, "--eval-data", val, "--vocab-size", str(VOCABULARY), "--max-steps", "20",
                "--learning-rate", "3e-3", "--eval-strategy", "no", "--save-strategy", "steps", "--save-steps", "20",
                "--disable-tqdm", "--output-dir", os.path.join(work, "run")]
        code, output = harness.run_launcher(2, argv, work, timeout=300)
        self.assertEqual(code, 0, output)
        self.assertIn(f"{VOCABULARY} in the vocabulary", output)
        prompt = "The meaning of life"
        done = subprocess.run([gpt_binary(), "generate", "--checkpoint", os.path.join(work, "run", "checkpoint-20"),
                               "--tokenizer", self.model + ".model", "--prompt", prompt, "--max-new-tokens", "12"],
                              capture_output=True, text=True, timeout=120, env=harness.base_env())
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        print(f"generated: {done.stdout.strip()!r}", flush=True)
        self.assertTrue(done.stdout.startswith(prompt), done.stdout)
        self.assertGreater(len(done.stdout.strip()), len(prompt), done.stdout)


if __name__ == "__main__":
    unittest.main(verbosity=2)
