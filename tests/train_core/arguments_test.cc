// TrainingArguments from flags and files, their validation, and the learning-rate schedules.
#include "lockstep/train_core/arguments.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "lockstep/error.h"
#include "lockstep/train_core/blas.h"
#include "lockstep/train_core/progress.h"
#include "lockstep/train_core/schedule.h"
#include "lockstep/train_core/trace.h"

using lockstep::ConfigError;
using namespace lockstep::train;

namespace {

TrainingArguments parse(std::vector<std::string> args) {
  std::vector<const char*> argv = {"prog"};
  for (auto& a : args) argv.push_back(a.c_str());
  return parse_arguments(static_cast<int>(argv.size()), argv.data());
}

std::string error_of(std::vector<std::string> args) {
  try {
    parse(std::move(args));
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "(no error)";
}

std::string temp_file(const std::string& name, const std::string& text) {
  std::string path = ::testing::TempDir() + "/" + std::to_string(::getpid()) + "_" + name;
  std::ofstream(path) << text;
  return path;
}

}  // namespace

TEST(Arguments, FlagsTakeDashesOrUnderscoresWithSpaceOrEquals) {
  auto a =
      parse({"--per-device-train-batch-size", "32", "--gradient_accumulation_steps=4", "--learning-rate=0.1",
             "--lr_scheduler_type", "cosine", "--bf16", "--max-steps", "100", "--optim", "sgd"});
  EXPECT_EQ(a.per_device_train_batch_size, 32);
  EXPECT_EQ(a.gradient_accumulation_steps, 4);
  EXPECT_DOUBLE_EQ(a.learning_rate, 0.1);
  EXPECT_EQ(a.lr_scheduler_type, "cosine");
  EXPECT_TRUE(a.bf16);
  EXPECT_EQ(a.max_steps, 100);
  EXPECT_EQ(a.optim, "sgd");
  // Untouched values keep their defaults.
  EXPECT_EQ(a.per_device_eval_batch_size, TrainingArguments{}.per_device_eval_batch_size);
}

TEST(Arguments, YamlFileThenFlagsOverrideIt) {
  std::string path = temp_file("run.yaml",
                               "per_device_train_batch_size: 16\n"
                               "learning-rate: 0.05\n"
                               "lr_scheduler_type: linear\n"
                               "bf16: true\n"
                               "output_dir: /tmp/somewhere\n");
  auto a = parse({"--config", path, "--learning-rate", "0.2"});
  EXPECT_EQ(a.per_device_train_batch_size, 16);
  EXPECT_DOUBLE_EQ(a.learning_rate, 0.2);  // the flag wins
  EXPECT_TRUE(a.bf16);
  EXPECT_EQ(a.output_dir, "/tmp/somewhere");
  EXPECT_EQ(a.config, path);
}

TEST(Arguments, JsonFileWorksToo) {
  std::string path =
      temp_file("run.json", R"({"gradient_accumulation_steps": 8, "optim": "sgd", "seed": 7})");
  auto a = parse({"--config=" + path});
  EXPECT_EQ(a.gradient_accumulation_steps, 8);
  EXPECT_EQ(a.optim, "sgd");
  EXPECT_EQ(a.seed, 7u);
}

TEST(Arguments, BadValuesAreErrorsNamingTheFlag) {
  EXPECT_NE(error_of({"--per-device-train-batch-size", "0"})
                .find("--per-device-train-batch-size must be at least 1"),
            std::string::npos);
  EXPECT_NE(error_of({"--learning-rate", "-0.1"}).find("--learning-rate must be at least 0"),
            std::string::npos);
  std::string sched = error_of({"--lr-scheduler-type", "exponential"});
  EXPECT_NE(sched.find("--lr-scheduler-type must be one of constant"), std::string::npos) << sched;
  EXPECT_NE(sched.find("'exponential'"), std::string::npos) << sched;
  std::string unknown = error_of({"--per-device-batch-size", "8"});
  EXPECT_NE(unknown.find("--per-device-batch-size"), std::string::npos) << unknown;
  EXPECT_NE(unknown.find("--help"), std::string::npos) << unknown;
  std::string not_number = error_of({"--learning-rate", "fast"});
  EXPECT_NE(not_number.find("learning-rate"), std::string::npos) << not_number;
  EXPECT_NE(error_of({"--gradient-accumulation-steps", "0"}).find("--gradient-accumulation-steps"),
            std::string::npos);
  EXPECT_NE(error_of({"--early-stopping-patience", "2"}).find("--eval-strategy"), std::string::npos);
  EXPECT_NE(error_of({"--num-train-epochs", "0"}).find("--num-train-epochs"), std::string::npos);
  EXPECT_NE(error_of({"--powersgd-rounds", "3"}).find("--powersgd-rounds must be 1 or even"), std::string::npos);
  EXPECT_EQ(error_of({"--powersgd-rounds", "6"}), "(no error)");
  EXPECT_EQ(error_of({"--num-train-epochs", "0", "--max-steps", "10"}), "(no error)");
  EXPECT_NE(error_of({"--load-best-model-at-end"}).find("--save-strategy and --eval-strategy"),
            std::string::npos);
  EXPECT_NE(error_of({"--load-best-model-at-end", "--eval-strategy", "steps", "--save-strategy", "steps",
                      "--eval-steps", "3", "--save-steps", "10"})
                .find("multiple of --eval-steps"),
            std::string::npos);
  EXPECT_EQ(error_of({"--load-best-model-at-end", "--eval-strategy", "epoch", "--save-strategy", "epoch"}),
            "(no error)");
  EXPECT_NE(error_of({"--fp16", "--bf16"}).find("choose one"), std::string::npos);
  EXPECT_EQ(error_of({"--fp16", "--zero-stage", "2"}), "(no error)");
  EXPECT_EQ(error_of({"--fp16", "--sync-every", "4"}), "(no error)");
  EXPECT_EQ(error_of({"--fp16"}), "(no error)");
}

// Each refusal of a pipelined run names the flag and what to do instead, before anything starts;
// the same flags without --pipeline-parallel pass, so the refusal is the pipeline's.
TEST(Arguments, PipeliningRefusesWhatItDoesNotCombineWithYet) {
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), {"--pipeline-parallel", "2"});
    return error_of(more);
  };
  EXPECT_EQ(with({}), "(no error)");
  EXPECT_EQ(with({"--bf16", "--gradient-checkpointing", "--save-format", "sharded"}), "(no error)");
  EXPECT_EQ(with({"--fp16"}), "(no error)");  // the stages agree on each step's overflow
  EXPECT_EQ(with({"--zero-stage", "1"}), "(no error)");  // the optimizer state over a stage's replicas
  const std::pair<std::vector<std::string>, std::string> refused[] = {
      {{"--sync-every", "4"}, "--sync-every does not combine with --pipeline-parallel 2"},
      {{"--save-format", "consolidated"}, "`lockstep checkpoint consolidate` makes model.pt"},
      {{"--zero-stage", "2"}, "--zero-stage 2 does not combine with --pipeline-parallel 2"},
      {{"--gradient-checkpointing", "--pipeline-schedule", "zb"}, "use 1f1b or interleaved"},
      {{"--virtual-stages", "2"}, "needs --pipeline-schedule interleaved"},
  };
  for (const auto& [flags, message] : refused) {
    EXPECT_EQ(error_of(flags), flags.front() == "--virtual-stages"
                                   ? "--virtual-stages is a pipeline setting: add --pipeline-parallel 2 or more"
                                   : "(no error)")
        << flags.front();
    const std::string e = with(flags);
    EXPECT_NE(e.find(message), std::string::npos) << flags.front() << ": " << e;
  }
}

TEST(Arguments, TensorParallelismRefusesWhatItDoesNotCombineWithYet) {
  const std::vector<std::string> split = {"--tensor-parallel", "2", "--save-strategy", "no"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), split.begin(), split.end());
    return error_of(more);
  };
  EXPECT_EQ(with({}), "(no error)");
  EXPECT_EQ(with({"--gradient-checkpointing", "--bf16", "--sequence-parallel"}), "(no error)");
  EXPECT_EQ(with({"--fp16"}), "(no error)");  // the tensor group agrees on each step's overflow
  EXPECT_EQ(with({"--zero-stage", "1"}), "(no error)");  // the optimizer state over the data ranks
  EXPECT_EQ(with({"--zero-stage", "2"}), "(no error)");  // and the gradients, by flat slices
  EXPECT_EQ(with({"--zero-stage", "3"}), "(no error)");  // and the parameters
  // Each tensor rank runs its own pipeline over its shards (P x D x T).
  EXPECT_EQ(with({"--pipeline-parallel", "2", "--sequence-parallel", "--zero-stage", "1"}), "(no error)");
  // Checkpoints hold whole tensors: saving and resuming are taken, in the sharded format.
  EXPECT_EQ(error_of({"--tensor-parallel", "2", "--resume-from-checkpoint", "latest"}), "(no error)");
  const std::pair<std::vector<std::string>, std::string> refused[] = {
      {{"--zero-stage", "2", "--zero-shared-parameters"}, "--zero-shared-parameters does not combine with "
                                                          "--tensor-parallel 2"},
      {{"--sync-every", "4"}, "--sync-every does not combine"},
      {{"--pipeline-parallel", "2", "--zero-stage", "2"}, "--zero-stage 2 does not combine with --pipeline-parallel 2"},
      {{"--save-format", "consolidated"}, "--save-format consolidated needs one worker holding the whole model"},
  };
  for (const auto& [flags, message] : refused) {
    const std::string e = with(flags);
    EXPECT_NE(e.find(message), std::string::npos) << flags.front() << ": " << e;
  }
  EXPECT_NE(error_of({"--sequence-parallel"}).find("add --tensor-parallel 2 or more"), std::string::npos);
  EXPECT_NE(error_of({"--tensor-parallel", "0"}).find("--tensor-parallel"), std::string::npos);
}

TEST(Arguments, CudaGraphsAreRefusedWithWhatTheyDoNotCapture) {
  const std::vector<std::string> graphs = {"--cuda-graphs", "--device", "cuda"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), graphs.begin(), graphs.end());
    return error_of(more);
  };
  EXPECT_EQ(with({}), "(no error)");
  EXPECT_EQ(with({"--bf16", "--optim", "adamw_torch_fused", "--max-grad-norm", "0"}), "(no error)");
  EXPECT_NE(error_of({"--cuda-graphs"}).find("--cuda-graphs captures a GPU's step: add --device cuda"), std::string::npos);
  const std::pair<std::vector<std::string>, std::string> refused[] = {
      {{"--optim", "sgd"}, "--optim adamw"},
      {{"--fp16"}, "--bf16"},
      {{"--gradient-accumulation-steps", "2"}, "--per-device-train-batch-size"},
      {{"--gradient-checkpointing"}, "--gradient-checkpointing"},
      {{"--zero-stage", "1"}, "--zero-stage"},
      {{"--pipeline-parallel", "2"}, "--pipeline-parallel"},
      {{"--sync-every", "4"}, "--sync-every"},
  };
  for (const auto& [flags, fix] : refused) {
    const std::string e = with(flags);
    EXPECT_EQ(e.rfind("--cuda-graphs ", 0), 0u) << flags.front() << ": " << e;
    EXPECT_NE(e.find(fix), std::string::npos) << flags.front() << ": " << e;
  }
}

TEST(Arguments, BadConfigFilesAreErrorsNamingTheFileAndKey) {
  std::string unknown = error_of({"--config", temp_file("u.yaml", "learning_rate: 0.1\nbatchsize: 8\n")});
  EXPECT_NE(unknown.find("unknown setting 'batchsize'"), std::string::npos) << unknown;
  std::string broken = error_of({"--config", temp_file("b.json", "{\"seed\": [1, 2")});
  EXPECT_NE(broken.find("b.json"), std::string::npos) << broken;
  std::string missing = error_of({"--config", "/nonexistent/run.yaml"});
  EXPECT_NE(missing.find("/nonexistent/run.yaml"), std::string::npos) << missing;
  std::string nested = error_of({"--config", temp_file("n.yaml", "seed:\n  a: 1\n")});
  EXPECT_NE(nested.find("'seed' must be a single value"), std::string::npos) << nested;
}

TEST(Arguments, HelpListsTheFlagsWithDefaultsAndExitsZero) {
  EXPECT_EXIT(parse({"--help"}), ::testing::ExitedWithCode(0), "");
  CLI::App app;
  TrainingArguments a;
  add_arguments(app, a);
  std::string help = app.help();
  for (const char* flag : {"--per-device-train-batch-size",
                           "--gradient-accumulation-steps",
                           "--num-train-epochs",
                           "--max-steps",
                           "--learning-rate",
                           "--lr-scheduler-type",
                           "--warmup-steps",
                           "--weight-decay",
                           "--max-grad-norm",
                           "--optim",
                           "--bf16",
                           "--logging-steps",
                           "--eval-strategy",
                           "--eval-steps",
                           "--save-strategy",
                           "--save-steps",
                           "--save-total-limit",
                           "--resume-from-checkpoint",
                           "--seed",
                           "--dataloader-num-workers",
                           "--ddp-bucket-cap-mb",
                           "--backend",
                           "--output-dir"})
    EXPECT_NE(help.find(flag), std::string::npos) << flag;
  EXPECT_NE(help.find("=64"), std::string::npos) << help;  // a default is shown
}

TEST(Arguments, CustomDefaultsAndProgramOptions) {
  TrainingArguments defaults;
  defaults.num_train_epochs = 5;
  std::string model = "cnn";
  std::vector<const char*> argv = {"prog", "--model", "mlp", "--seed", "3"};
  auto a = parse_arguments(
      static_cast<int>(argv.size()), argv.data(), [&](CLI::App& app) { app.add_option("--model", model); },
      "", defaults);
  EXPECT_EQ(model, "mlp");
  EXPECT_EQ(a.num_train_epochs, 5);
  EXPECT_EQ(a.seed, 3u);
}

TEST(Arguments, JsonRoundTripNamesEveryField) {
  TrainingArguments a;
  a.learning_rate = 0.25;
  auto j = a.to_json();
  EXPECT_DOUBLE_EQ(j.at("learning_rate").get<double>(), 0.25);
  EXPECT_EQ(j.at("per_device_train_batch_size").get<int>(), 64);
  EXPECT_TRUE(j.contains("lr_scheduler_type"));
}

TEST(Schedule, LinearWarmsUpThenFallsToZero) {
  Schedule s{"linear", 10, 110};
  EXPECT_DOUBLE_EQ(s.multiplier(0), 0.0);
  EXPECT_DOUBLE_EQ(s.multiplier(5), 0.5);
  EXPECT_DOUBLE_EQ(s.multiplier(10), 1.0);
  EXPECT_DOUBLE_EQ(s.multiplier(60), 0.5);
  EXPECT_DOUBLE_EQ(s.multiplier(110), 0.0);
  EXPECT_DOUBLE_EQ(s.multiplier(200), 0.0);  // past the end stays at 0
}

TEST(Schedule, CosineIsHalfwayAtTheMiddleAndZeroAtTheEnd) {
  Schedule s{"cosine", 0, 100};
  EXPECT_DOUBLE_EQ(s.multiplier(0), 1.0);
  EXPECT_NEAR(s.multiplier(50), 0.5, 1e-12);
  EXPECT_NEAR(s.multiplier(25), 0.5 * (1 + std::cos(M_PI * 0.25)), 1e-12);
  EXPECT_NEAR(s.multiplier(100), 0.0, 1e-12);
  for (int i = 1; i <= 100; ++i) EXPECT_LE(s.multiplier(i), s.multiplier(i - 1));
}

TEST(Schedule, ConstantIgnoresWarmupButConstantWithWarmupDoesNot) {
  EXPECT_DOUBLE_EQ((Schedule{"constant", 10, 100}.multiplier(0)), 1.0);
  EXPECT_DOUBLE_EQ((Schedule{"constant_with_warmup", 10, 100}.multiplier(2)), 0.2);
  EXPECT_DOUBLE_EQ((Schedule{"constant_with_warmup", 10, 100}.multiplier(99)), 1.0);
  EXPECT_THROW((Schedule{"step", 0, 10}.multiplier(1)), ConfigError);
  EXPECT_EQ(warmup_steps_for(0, 0.1, 95), 10);
  EXPECT_EQ(warmup_steps_for(7, 0.1, 95), 7);
}

TEST(Progress, BarAndLineShowTheStepRateLossAndEta) {
  std::string bar = progress_bar(42, 100, 10, 14, rate_text(3812.4, 0), 0.43219);
  EXPECT_NE(bar.find(" 42% |##########              | 42/100 [00:10<00:14, 3812 samples/s, loss 0.4322]"),
            std::string::npos)
      << bar;
  std::string line = progress_line(100, 1000, 0.213, 0.54321, 0.00199, rate_text(3812, 0), 0.041, 83);
  EXPECT_EQ(
      line,
      "step 100/1000 (epoch 0.21): loss 0.5432, lr 0.00199, 3812 samples/s, exposed comm 4.1%, ETA 01:23");
  EXPECT_EQ(format_duration(3723), "1:02:03");
  EXPECT_EQ(rate_text(44.2, 5603.3), "5603 tokens/s") << "a per-token task counts tokens";
}

TEST(Trace, AChromeTraceFileIsOneJsonArrayWithTracksAndSpans) {
  std::string path = ::testing::TempDir() + "/" + std::to_string(::getpid()) + "_trace.json";
  {
    TraceWriter w(path, 3);
    auto t0 = TraceWriter::Clock::now();
    w.span("forward", 1, t0, t0 + std::chrono::milliseconds(2), {{"micro_batch", 0}});
    w.span("all-reduce", 2, t0 + std::chrono::milliseconds(1), t0);  // end before begin: zero length
  }
  std::ifstream in(path);
  auto events = nlohmann::json::parse(in);
  ASSERT_TRUE(events.is_array());
  ASSERT_EQ(events.size(), 5u);  // process name, two track names, two spans
  EXPECT_EQ(events[3]["name"], "forward");
  EXPECT_EQ(events[3]["pid"], 3);
  EXPECT_NEAR(events[3]["dur"].get<double>(), 2000, 1);
  EXPECT_EQ(events[4]["dur"].get<double>(), 0);
  EXPECT_GT(events[3]["ts"].get<double>(), 1.7e15);  // microseconds since 1970, so ranks line up
  EXPECT_THROW(TraceWriter("/nonexistent/dir/t.json", 0), ConfigError);
}

namespace lockstep::train {
namespace {

// Debian 12's OpenBLAS on Emerald Rapids: Prescott where SkylakeX would run.
TEST(Blas, AdviceOnlyWhenTheKernelsAreBelowTheCpusAndNothingWasForced) {
  auto advice = blas_advice("Prescott", "SkylakeX", false);
  EXPECT_NE(advice.find("OPENBLAS_CORETYPE=SkylakeX"), std::string::npos) << advice;
  EXPECT_NE(advice.find("Prescott"), std::string::npos) << advice;
  EXPECT_EQ(blas_advice("Prescott", "SkylakeX", true), "");     // the user chose
  EXPECT_EQ(blas_advice("SkylakeX", "SkylakeX", false), "");    // already the best
  EXPECT_EQ(blas_advice("Cooperlake", "SkylakeX", false), "");  // as good
  EXPECT_EQ(blas_advice("Zen", "Haswell", false), "");
  EXPECT_NE(blas_advice("Sandybridge", "Haswell", false), "");
  EXPECT_EQ(blas_advice("", "SkylakeX", false), "");  // not OpenBLAS
  EXPECT_EQ(blas_advice("SomeFutureCore", "SkylakeX", false), "");
}

}  // namespace
}  // namespace lockstep::train
