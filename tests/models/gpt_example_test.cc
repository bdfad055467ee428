// examples/gpt end to end, as a user runs it: pretraining under `lockstep run` on two workers,
// resume, gradient checkpointing through the Trainer flag, sampling, fine-tuning from the
// checkpoint, the report page, a Hugging Face GPT-2 directory out and back in, and the one-line
// errors for bad input. A small model on the real
// fortune corpus (Debian's fortunes, installed by the set-up), so each run takes seconds.
// Torch-free: it reads what the program writes.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "metrics_file.h"
#include "testing.h"

namespace {

namespace fs = std::filesystem;
using lockstep::testing::metrics_events;
using lockstep::testing::Process;
using lockstep::testing::TempDir;

const std::vector<std::string> kSmallModel = {"--n-layer", "2", "--n-head", "2", "--n-embd", "64", "--block-size", "32"};

std::vector<std::string> gpt(const std::vector<std::vector<std::string>>& parts, int nproc = 2) {
  std::vector<std::string> argv = {LOCKSTEP_BINARY, "run", "--nproc-per-node", std::to_string(nproc), GPT_EXAMPLE};
  for (const auto& p : parts) argv.insert(argv.end(), p.begin(), p.end());
  return argv;
}

// 20 steps of 2 x 16 blocks of 32 bytes; evaluation and a checkpoint every 10 steps.
std::vector<std::string> pretrain_flags(const std::string& out) {
  return {"--train-limit", "320",  "--eval-limit", "64",           "--max-steps",  "20",
          "--eval-steps",  "10",   "--save-steps", "10",           "--logging-steps", "5",
          "--disable-tqdm", "--output-dir", out};
}

// The replica fingerprint the Trainer prints at the end: a hash of every parameter's bytes.
std::string fingerprint(const std::string& output) {
  const auto at = output.rfind("(fingerprint ");
  return at == std::string::npos ? "" : output.substr(at + 13, 16);
}

std::string run_ok(const std::vector<std::string>& argv, double timeout = 240) {
  Process p(argv);
  const int code = p.wait(timeout);
  EXPECT_EQ(code, 0) << p.output();
  return p.output();
}

// The line a failed run prints, and its exit code, for a command expected to fail on bad input.
std::pair<int, std::string> run_fail(const std::vector<std::string>& argv) {
  Process p(argv);
  const int code = p.wait(60);
  return {code, p.output()};
}

class GptExample : public ::testing::Test {
 protected:
  // One pretraining run shared by the tests that only read it.
  static void SetUpTestSuite() {
    dir_ = new TempDir("gpt");
    output_ = new std::string(run_ok(gpt({kSmallModel, pretrain_flags(dir_->path())})));
  }
  static void TearDownTestSuite() {
    delete output_;
    delete dir_;
  }
  static std::string out() { return dir_->path(); }
  static TempDir* dir_;
  static std::string* output_;
};
TempDir* GptExample::dir_ = nullptr;
std::string* GptExample::output_ = nullptr;

// Per-token metrics: tokens/s is samples/s times the block (over the same seconds, whatever the
// window's closing collectives wait: a loaded host once made the two disagree by 7%), perplexity
// is exp(eval_loss), every validation byte is evaluated, and the loss falls below a uniform guess
// over 256 bytes.
TEST_F(GptExample, PretrainingLogsTokensAndPerplexityAndLearns) {
  const auto logs = metrics_events(out() + "/metrics.jsonl", "log");
  const auto evals = metrics_events(out() + "/metrics.jsonl", "eval");
  ASSERT_EQ(logs.size(), 4u) << *output_;
  ASSERT_EQ(evals.size(), 2u) << *output_;
  for (const auto& l : logs) {
    ASSERT_TRUE(l.contains("tokens_per_second")) << l;
    EXPECT_NEAR(l["tokens_per_second"].get<double>() / l["samples_per_second"].get<double>(), 32.0, 32.0 * 1e-9);
  }
  for (const auto& e : evals) {
    EXPECT_EQ(e["eval_samples"].get<int>(), 64);
    EXPECT_EQ(e["eval_tokens"].get<int>(), 64 * 32);
    EXPECT_NEAR(e["eval_perplexity"].get<double>(), std::exp(e["eval_loss"].get<double>()), 1e-9 * e["eval_perplexity"].get<double>());
  }
  EXPECT_LT(evals[1]["eval_loss"].get<double>(), evals[0]["eval_loss"].get<double>());
  EXPECT_LT(evals[1]["eval_loss"].get<double>(), std::log(256.0));
  EXPECT_NE(output_->find("tokens/s"), std::string::npos) << "the progress line counts tokens";
  const auto begin = metrics_events(out() + "/metrics.jsonl", "train_begin");
  ASSERT_EQ(begin.size(), 1u);
  EXPECT_GT(begin[0]["parameter_bytes"].get<double>(), 0);
  EXPECT_FALSE(begin[0]["gradient_checkpointing"].get<bool>());
}

// Resuming from step 10 ends with parameters bitwise equal to the uninterrupted run's: dropout's
// RNG, the data order and the optimiser all continue where they were.
TEST_F(GptExample, AResumedRunEndsBitwiseEqual) {
  TempDir resumed("gpt-resumed");
  const std::string a = fingerprint(*output_);
  ASSERT_FALSE(a.empty()) << *output_;
  const std::string out2 = run_ok(gpt({kSmallModel, pretrain_flags(resumed.path()),
                                       {"--resume-from-checkpoint", out() + "/checkpoint-10"}}));
  EXPECT_EQ(fingerprint(out2), a) << out2;
}

// --gradient-checkpointing under DDP on two workers, dropout on: the same training, to float
// reassociation (the gradients differ by ulps, see models_test), and it says so in metrics.jsonl.
TEST_F(GptExample, GradientCheckpointingTrainsTheSameUnderDdp) {
  TempDir ckpt("gpt-ckpt");
  run_ok(gpt({kSmallModel, pretrain_flags(ckpt.path()), {"--gradient-checkpointing"}}));
  const auto plain = metrics_events(out() + "/metrics.jsonl", "eval");
  const auto recomputed = metrics_events(ckpt / "metrics.jsonl", "eval");
  ASSERT_EQ(recomputed.size(), plain.size());
  for (std::size_t i = 0; i < plain.size(); ++i)
    EXPECT_NEAR(recomputed[i]["eval_loss"].get<double>(), plain[i]["eval_loss"].get<double>(),
                1e-4 * plain[i]["eval_loss"].get<double>());
  const auto begin = metrics_events(ckpt / "metrics.jsonl", "train_begin");
  EXPECT_TRUE(begin.at(0)["gradient_checkpointing"].get<bool>());
}

// Sampling is reproducible for a seed, continues the prompt, and a checkpoint carries its shape.
TEST_F(GptExample, GenerateContinuesThePromptReproducibly) {
  const std::string ckpt = out() + "/checkpoint-20";
  ASSERT_TRUE(fs::exists(ckpt + "/config.json"));
  auto sample = [&](const std::string& seed) {
    return run_ok({GPT_EXAMPLE, "generate", "--checkpoint", ckpt, "--prompt", "The ", "--max-new-tokens", "40",
                   "--seed", seed});
  };
  const std::string a = sample("1"), b = sample("1"), c = sample("2");
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_EQ(a.rfind("The ", 0), 0u) << a;
  EXPECT_GE(a.size(), 4u + 40u) << a;

  // --device cuda: on a GPU it samples there too; elsewhere it is an error that says why.
  Process on_gpu({GPT_EXAMPLE, "generate", "--checkpoint", ckpt, "--prompt", "The ", "--max-new-tokens", "40",
                  "--seed", "1", "--device", "cuda"});
  const int code = on_gpu.wait(120);
  if (code == 0) {
    EXPECT_EQ(on_gpu.output().rfind("The ", 0), 0u) << on_gpu.output();
  } else {
    EXPECT_EQ(code, 2) << on_gpu.output();
    EXPECT_NE(on_gpu.output().find("--device cuda: "), std::string::npos) << on_gpu.output();
  }
}

// Fine-tuning loads the body, reports the new head as from_pretrained does, and names its classes.
TEST_F(GptExample, FinetuneLoadsTheBodyAndReportsTheNewHead) {
  TempDir ft("gpt-ft");
  const std::string o = run_ok(gpt({{"finetune", "--pretrained", out() + "/checkpoint-20", "--max-steps", "4",
                                     "--disable-tqdm", "--output-dir", ft.path()}}));
  EXPECT_NE(o.find("newly initialised (not in the checkpoint): score.weight\n"), std::string::npos) << o;
  EXPECT_NE(o.find("not used (in the checkpoint, not in this model): none"), std::string::npos) << o;
  EXPECT_NE(o.find("classes (categories with at least 500 entries): computers"), std::string::npos) << o;
  std::ifstream in(ft / "eval_results.json");
  const auto results = nlohmann::json::parse(in);
  EXPECT_GE(results["classes"].size(), 2u);
  EXPECT_GT(results["eval_samples"].get<int>(), 0);
}

// lockstep report shows a language model's tokens/s and perplexity.
TEST_F(GptExample, TheReportShowsTokensPerSecondAndPerplexity) {
  run_ok({LOCKSTEP_BINARY, "report", out()});
  const std::string html = lockstep::testing::read_file(out() + "/report.html");
  EXPECT_NE(html.find("id='sum-tps'"), std::string::npos);
  EXPECT_NE(html.find("id='sum-ppl'"), std::string::npos);
  EXPECT_NE(html.find("<th>eval perplexity</th>"), std::string::npos);
}

// nanoGPT's flat uint16 file of `tokens` repetitions of a 5-token cycle above the byte range
// (300, 301, ..., 304), starting at `phase`.
void write_cycle(const std::string& path, int tokens, int phase) {
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < tokens; ++i) {
    const std::uint16_t t = static_cast<std::uint16_t>(300 + (i + phase) % 5);
    out.write(reinterpret_cast<const char*>(&t), sizeof t);  // little-endian on every host we run
  }
}

// Token files instead of the fortunes: tokens past 255 read as themselves (a model trained on bytes
// could not learn the cycle: its targets would be out of its vocabulary), the loss falls far below
// a uniform guess over the vocabulary, and a token outside it is refused naming the file and offset.
TEST(GptTokenFiles, TrainsOnAFlatTokenFileAndRefusesATokenOutsideTheVocabulary) {
  TempDir dir("gpt-tokens");
  write_cycle(dir / "train.bin", 4000, 0);
  write_cycle(dir / "val.bin", 600, 2);
  const std::vector<std::string> data = {
      "--train-data",    dir / "train.bin", "--eval-data",     dir / "val.bin", "--vocab-size",   "320",
      "--learning-rate", "3e-3",            "--max-steps",     "30",            "--eval-strategy", "no",
      "--save-strategy", "no",              "--disable-tqdm",  "--output-dir",  dir / "run"};
  const std::string out = run_ok(gpt({kSmallModel, data}));
  EXPECT_NE(out.find("320 in the vocabulary"), std::string::npos) << out;
  EXPECT_NE(out.find(" nats/token,"), std::string::npos) << out;
  std::ifstream results(dir / "run/eval_results.json");
  const double loss = nlohmann::json::parse(results).at("eval_loss").get<double>();
  EXPECT_LT(loss, std::log(320.0) / 2) << "the cycle is certain: a model that reads the tokens learns it";
  std::ofstream(dir / "val.bin", std::ios::binary | std::ios::app).write("\x90\x01", 2);  // token 400, past 320
  const auto [code, msg] = run_fail(gpt({kSmallModel, data}, 1));
  EXPECT_NE(code, 0) << msg;
  EXPECT_NE(msg.find(dir / "val.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("byte offset 1200"), std::string::npos) << msg;
}

// ----- bad input: one line naming the problem and what to do, exit 2 ---------------------------

TEST(GptExampleErrors, AMissingCorpusNamesThePackage) {
  const auto [code, msg] = run_fail({GPT_EXAMPLE, "--corpus-dir", "/nonexistent/fortunes"});
  EXPECT_EQ(code, 2) << msg;
  EXPECT_NE(msg.find("apt-get install fortunes"), std::string::npos) << msg;
  EXPECT_EQ(lockstep::testing::count_of(msg, "\n"), 1u) << msg;
}

TEST_F(GptExample, ABlockSizeLargerThanTheModelsContextIsRefused) {
  const auto [code, msg] = run_fail({GPT_EXAMPLE, "finetune", "--pretrained", out() + "/checkpoint-20",
                                     "--block-size", "64"});
  EXPECT_EQ(code, 2) << msg;
  EXPECT_NE(msg.find("--block-size 64 is larger than the pretrained model's context (block_size 32)"),
            std::string::npos)
      << msg;
}

TEST_F(GptExample, ACheckpointOfAnotherArchitectureIsRefused) {
  // Not a GPT checkpoint at all (no config.json)...
  TempDir other("not-gpt");
  std::ofstream(other / "model.pt") << "x";
  auto [code, msg] = run_fail({GPT_EXAMPLE, "generate", "--checkpoint", other.path()});
  EXPECT_EQ(code, 2) << msg;
  EXPECT_NE(msg.find("no config.json"), std::string::npos) << msg;
  // ... and one whose config.json says another shape than its weights: the parameter is named.
  TempDir reshaped("gpt-reshaped");
  fs::copy(out() + "/checkpoint-20", reshaped.path(), fs::copy_options::recursive);
  auto config = nlohmann::json::parse(lockstep::testing::read_file(reshaped / "config.json"));
  config["n_embd"] = 128;
  std::ofstream(reshaped / "config.json") << config.dump();
  std::tie(code, msg) = run_fail({GPT_EXAMPLE, "generate", "--checkpoint", reshaped.path()});
  EXPECT_EQ(code, 2) << msg;
  EXPECT_NE(msg.find("transformer.wte.weight"), std::string::npos) << msg;
  EXPECT_EQ(lockstep::testing::count_of(msg, "\n"), 1u) << msg;
}

// A checkpoint exported as a Hugging Face GPT-2 directory is the same model (greedy generation
// from either gives the same tokens), training starts from it, and flags that would reshape it are
// refused. (That transformers reads it: tests/python/test_gpt2.py.)
TEST_F(GptExample, ACheckpointExportedForHuggingFaceIsTheSameModelAndTrainsOn) {
  TempDir hf("gpt-hf");
  const std::string ckpt = out() + "/checkpoint-20", exported = hf / "gpt2";
  run_ok({GPT_EXAMPLE, "export-hf", "--checkpoint", ckpt, "--output", exported});
  EXPECT_NE(lockstep::testing::read_file(exported + "/config.json").find("\"gpt2\""), std::string::npos);
  auto greedy = [&](const std::string& dir) {
    return run_ok({GPT_EXAMPLE, "generate", "--checkpoint", dir, "--prompt", "The ", "--max-new-tokens", "30",
                   "--temperature", "0", "--print-tokens"});
  };
  const std::string ours = greedy(ckpt);
  EXPECT_EQ(ours.rfind("84 104 101 32 ", 0), 0u) << ours;  // "The " as token ids
  EXPECT_EQ(greedy(exported), ours);

  TempDir again("gpt-from-hf");
  const std::string o = run_ok(gpt({{"train", "--from-hf", exported, "--block-size", "64", "--train-limit", "64",
                                     "--max-steps", "2", "--save-strategy", "no", "--eval-strategy", "no",
                                     "--disable-tqdm", "--output-dir", again.path()}}));
  EXPECT_NE(o.find("from " + exported), std::string::npos) << o;
  EXPECT_NE(o.find("blocks of 32"), std::string::npos) << "the blocks are at most the model's context: " << o;

  auto [code, msg] = run_fail({GPT_EXAMPLE, "train", "--from-hf", exported, "--n-embd", "128"});
  EXPECT_EQ(code, 2) << msg;
  EXPECT_NE(msg.find("--n-embd 128 differs from the pretrained model's 64"), std::string::npos) << msg;
  std::tie(code, msg) = run_fail({GPT_EXAMPLE, "export-hf", "--checkpoint", hf / "nothing", "--output", hf / "x"});
  EXPECT_EQ(code, 2) << msg;
  EXPECT_FALSE(fs::exists(hf / "x"));
}

}  // namespace
