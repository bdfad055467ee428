// Checkpoints and results in elastic jobs: whichever member dies, and whenever, every checkpoint
// the run asked for exists and loads, eval_results.json is written, every sample is trained once
// per epoch, and the final checkpoint holds what an uninterrupted run's holds.
//
// ElasticSave.RandomKills draws its trials: the ZeRO stage, the checkpoint limit, and the kill,
// either at a fault point (before the first membership's communicator is up; after a step, the
// last one too; inside a save; inside an evaluation; inside a join's state transfer; before or
// inside a ZeRO update) at a random step and rank, or a
// SIGKILL to a random worker at a random moment. LOCKSTEP_ELASTIC_TRIALS sets how many (3 in the
// suite; bench/elastic_trials runs a hundred and more), LOCKSTEP_TRIAL_SEED the first seed (each
// trial prints its own, to replay it alone).
//
// "Where an uninterrupted run ends": float summation order is all that separates a run that went
// 3 -> 2 -> 3 workers from one that stayed at 3, so the tolerance is twice the distance between
// uninterrupted runs of 2 and 3 workers, and at least 1e-6 (a lost or repeated step moves the
// parameters by 1e-3 and more; the runs print both figures). A third of the trials train with AdamW
// (lr 1e-3), whose per-element scaling turns the summation noise of near-zero gradients into
// lr-sized steps: its 2-vs-3 distance, and so its tolerance, is the larger one.
#include <gtest/gtest.h>
#include <signal.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <set>

#include "elastic_records.h"
#include "elastic_runs.h"
#include "lockstep/train/checkpoint.h"
#include "lockstep/train_core/durable_file.h"
#include "testing.h"

namespace fs = std::filesystem;

namespace lockstep::testing {
namespace {

constexpr int kSteps = 40, kSaveEvery = 10;

struct Trial {
  std::uint64_t seed = 0;
  bool adamw = false;  // else SGD with momentum
  int zero_stage = 0;
  bool limit_and_best = false;  // --save-total-limit 2 --load-best-model-at-end
  std::string fault;            // LOCKSTEP_FAULT_INJECT; empty: a kill at a random moment
  double kill_at = 0;           // ... as a fraction of the uninterrupted run's time

  std::string text() const {
    std::string t = "seed " + std::to_string(seed) + ": " + (adamw ? "adamw" : "sgd") + ", zero stage " +
                    std::to_string(zero_stage) +
                    (limit_and_best ? ", limit 2 + best" : "") + ", ";
    return t + (fault.empty() ? "SIGKILL to a random worker at " + std::to_string(kill_at) + " of the run" : fault);
  }
};

Trial draw(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<std::uint64_t>(n)); };
  Trial t;
  t.seed = seed;
  t.adamw = pick(3) == 0;
  t.zero_stage = pick(3);
  t.limit_and_best = pick(2) == 1;
  const std::string rank = std::to_string(pick(3));
  switch (pick(t.zero_stage > 0 ? 9 : 7)) {
    case 0: t.kill_at = std::uniform_real_distribution<double>(0.1, 1.0)(rng); break;
    case 1: t.fault = "kill-after-step:" + std::to_string(1 + pick(kSteps)) + ":" + rank; break;
    case 2: t.fault = "kill-after-step:" + std::to_string(kSteps) + ":" + rank; break;
    case 3: t.fault = "kill-during-save:" + std::to_string(kSaveEvery * (1 + pick(kSteps / kSaveEvery))); break;
    case 4: t.fault = "kill-during-eval:" + std::to_string(kSaveEvery * (1 + pick(kSteps / kSaveEvery))) + ":" + rank; break;
    case 5:  // a first loss, then the source of the joiner's state dies sending it
      t.fault = "kill-after-step:" + std::to_string(1 + pick(kSteps - 5)) + ":" + rank + ",kill-in-state-transfer:2:0";
      break;
    case 6: t.fault = "kill-before-communicator:0:" + rank; break;
    case 7: t.fault = "kill-before-update:" + std::to_string(1 + pick(kSteps)) + ":" + rank; break;
    default: t.fault = "kill-in-update:" + std::to_string(1 + pick(kSteps)) + ":" + rank; break;
  }
  return t;
}

std::vector<std::string> flags_of(bool adamw, int zero_stage, bool limit_and_best) {
  std::vector<std::string> f{"--optim", adamw ? "adamw" : "sgd", "--learning-rate", adamw ? "1e-3" : "0.05",
                             "--sgd-momentum", "0.9", "--save-strategy", "steps", "--save-steps", std::to_string(kSaveEvery),
                             "--eval-strategy", "steps", "--eval-steps", std::to_string(kSaveEvery),
                             "--eval-limit", "256", "--zero-stage", std::to_string(zero_stage)};
  if (limit_and_best) f.insert(f.end(), {"--save-total-limit", "2", "--load-best-model-at-end"});
  return f;
}

// What a trial is compared with: the final checkpoint of an uninterrupted 3-worker run, and the
// tolerance from a 2-worker run of the same global batch.
struct Reference {
  std::vector<torch::Tensor> parameters;
  double tolerance = 0;
  double two_versus_three = 0;
  double seconds = 0;  // the 3-worker run's, from its launch to its exit
};

std::string final_model(const std::string& dir) {
  return dir + "/out/checkpoint-" + std::to_string(kSteps) + "/model.pt";
}

Reference measure_reference(bool adamw) {
  TempDir three("elastic-save-ref3"), two("elastic-save-ref2");
  const auto begin = std::chrono::steady_clock::now();
  auto a = elastic_run(three.path(), 3, 32, kSteps, {}, flags_of(adamw, 0, false));
  EXPECT_EQ(a->wait(300), 0) << a->output();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  auto b = elastic_run(two.path(), 2, 48, kSteps, {}, flags_of(adamw, 0, false));
  EXPECT_EQ(b->wait(300), 0) << b->output();
  Reference r;
  r.seconds = seconds;
  r.parameters = parameters_in(final_model(three.path()));
  r.two_versus_three = max_difference(parameters_in(final_model(two.path())), r.parameters);
  r.tolerance = std::max(2 * r.two_versus_three, 1e-6);
  return r;
}

const Reference& reference(bool adamw) {
  static const Reference sgd = measure_reference(false);
  if (!adamw) return sgd;
  static const Reference with_adamw = measure_reference(true);
  return with_adamw;
}

// "" when the checkpoint is complete and loads (model and SGD state), else why not.
std::string check_checkpoint(const fs::path& dir, std::int64_t step, bool adamw) {
  if (!fs::exists(dir / "trainer_state.json")) return dir.filename().string() + " is missing";
  try {
    const auto state = train::read_json_file((dir / "trainer_state.json").string(), "trainer state");
    if (state.at("global_step").get<std::int64_t>() != step) return dir.string() + " holds another step";
    Mlp m;
    train::load_module(*m, (dir / "model.pt").string());
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    if (adamw)
      optimizer = std::make_unique<torch::optim::AdamW>(m->parameters(), torch::optim::AdamWOptions(1e-3));
    else
      optimizer = std::make_unique<torch::optim::SGD>(m->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    train::load_optimizer(*optimizer, (dir / "optimizer.pt").string());
  } catch (const std::exception& e) {
    return dir.filename().string() + " does not load: " + e.what();
  }
  return "";
}

// "" when the run kept its promises, else the first one it broke.
std::string check_run(const std::string& dir, const Trial& t, const Reference& ref, double* difference) {
  const fs::path out = fs::path(dir) / "out";
  std::set<std::int64_t> expected;
  for (std::int64_t s = kSaveEvery; s <= kSteps; s += kSaveEvery) expected.insert(s);
  if (t.limit_and_best) {  // the newest and the best (with the limit at 2, one may be both)
    expected = {kSteps};
    const auto state = train::read_json_file((out / ("checkpoint-" + std::to_string(kSteps)) / "trainer_state.json").string(), "trainer state");
    const std::string best = state.value("best_checkpoint", "");
    if (best.empty()) return "checkpoint-" + std::to_string(kSteps) + " names no best checkpoint";
    expected.insert(train::checkpoint_step(best));
    if (train::list_checkpoints(out.string()).size() > 2) return "more than 2 checkpoints kept";
  }
  for (std::int64_t s : expected)
    if (auto wrong = check_checkpoint(out / ("checkpoint-" + std::to_string(s)), s, t.adamw); !wrong.empty())
      return wrong;
  if (!fs::exists(out / "eval_results.json")) return "no eval_results.json";
  if (train::read_json_file((out / "eval_results.json").string(), "results").value("global_step", 0) != kSteps)
    return "eval_results.json is not the final step's";
  if (auto wrong = each_sample_once_per_epoch(trained_samples(dir), 20, kSteps / 20, kSamples); !wrong.empty())
    return wrong;
  *difference = max_difference(parameters_in(final_model(dir)), ref.parameters);
  if (*difference > ref.tolerance)
    return "final parameters " + std::to_string(*difference) + " from the uninterrupted run's (tolerance " +
           std::to_string(ref.tolerance) + ")";
  return "";
}

// A live worker of the run in `dir` (each one records into DIR/<pid>.samples), or 0.
pid_t random_live_worker(const std::string& dir, std::mt19937_64& rng) {
  std::vector<pid_t> live;
  for (const auto& f : fs::directory_iterator(dir))
    if (f.path().extension() == ".samples") {
      const pid_t pid = std::atoi(f.path().stem().c_str());
      if (pid > 0 && ::kill(pid, 0) == 0) live.push_back(pid);
    }
  return live.empty() ? 0 : live[rng() % live.size()];
}

struct Outcome {
  std::string wrong;  // "" when every promise held
  std::size_t changes = 0;
  std::size_t kills = 0;  // workers the launcher saw die of SIGKILL
  bool redone = false;  // a checkpoint or what followed a step was completed on a new membership
  double difference = 0;
  std::string first_change;  // the first membership_change record: its membership, reason and who left
};

Outcome run_trial(const Trial& t) {
  const Reference& ref = reference(t.adamw);
  TempDir dir("elastic-trial");
  std::map<std::string, std::string> env;
  if (!t.fault.empty()) env["LOCKSTEP_FAULT_INJECT"] = t.fault;
  auto run = elastic_run(dir.path(), 3, 32, kSteps, env, flags_of(t.adamw, t.zero_stage, t.limit_and_best));
  if (t.fault.empty()) {  // reading its output until the moment comes, then a kill
    std::mt19937_64 rng(t.seed);
    if (!run->read_until("\x01 never printed", t.kill_at * ref.seconds))
      if (pid_t victim = random_live_worker(dir.path(), rng)) ::kill(victim, SIGKILL);
  }
  Outcome o;
  const int code = run->wait(300);
  if (code != 0) {
    const std::string& all = run->output();
    o.wrong = "exit " + std::to_string(code) + "; output ends:\n" + all.substr(all.size() > 3000 ? all.size() - 3000 : 0);
    return o;
  }
  const auto records = changes(dir.path());
  o.changes = records.size();
  if (!records.empty())
    o.first_change = "membership " + std::to_string(records.front().membership) + " from " +
                     std::to_string(records.front().world_size_before) + " workers: " + records.front().reason +
                     "; left: " + records.front().left;
  o.kills = count_of(run->output(), "was killed by SIGKILL");
  o.redone = run->output().find("completing what follows step") != std::string::npos;
  o.wrong = check_run(dir.path(), t, ref, &o.difference);
  if (!o.wrong.empty()) o.wrong += "\n" + run->output();
  return o;
}

// The case: the worker that writes the final checkpoint dies inside it. The new rank 0
// writes it, and the results after it.
TEST(ElasticSave, TheFinalCheckpointIsWrittenWhenItsWriterDiesInIt) {
  const Reference& ref = reference(false);
  const Outcome o = run_trial(Trial{1, false, 0, false, "kill-during-save:" + std::to_string(kSteps), 0});
  EXPECT_EQ(o.wrong, "");
  EXPECT_GE(o.changes, 1u) << "the writer died";
  EXPECT_TRUE(o.redone) << "the new membership completed the step's save";
  std::printf("final parameters %.3g from the uninterrupted run's; 2 vs 3 workers uninterrupted: %.3g\n",
              o.difference, ref.two_versus_three);
}

// Two losses: a worker after step 12, then, as its replacement joins (in the change that follows
// the loss, or in the next one, the survivors holding for it: await-joiner), the member sending it
// the state. The change starts over and the run keeps every promise (plain DDP: no shard is lost).
TEST(ElasticSave, AJoinWhoseSourceDiesStartsOver) {
  const Outcome o =
      run_trial(Trial{2, false, 0, false, "kill-after-step:12:1,await-joiner:1,kill-in-state-transfer:1:0,kill-in-state-transfer:2:0", 0});
  EXPECT_EQ(o.wrong, "");
  EXPECT_EQ(o.kills, 2u) << "the worker after step 12, and the source of the joiner's state";
  EXPECT_GE(o.changes, 2u) << "one change for each loss at least";
}

// A worker dies after the first membership is published, before its communicator is up: the
// others leave it out at once (not at the creation's timeout), start training in the next
// membership with the first one's global batch (ZeRO 2: nobody holds a shard yet), admit its
// replacement, and the run keeps every promise; metrics.jsonl records the change.
TEST(ElasticSave, AWorkerLostBeforeTheFirstCommunicatorFormedCostsOneChange) {
  const Outcome o = run_trial(Trial{3, false, 2, false, "kill-before-communicator:0:1", 0});
  EXPECT_EQ(o.wrong, "");
  EXPECT_EQ(o.kills, 1u);
  // metrics.jsonl tells of it as of any change: the first membership's 3 workers, local 1 gone.
  EXPECT_NE(o.first_change.find("membership 1 from 3 workers"), std::string::npos) << o.first_change;
  EXPECT_NE(o.first_change.find("while its communicator formed"), std::string::npos) << o.first_change;
  EXPECT_NE(o.first_change.find(" machine 0 local 1"), std::string::npos) << o.first_change;
}

TEST(ElasticSave, RandomKills) {
  const char* count_text = std::getenv("LOCKSTEP_ELASTIC_TRIALS");
  const char* seed_text = std::getenv("LOCKSTEP_TRIAL_SEED");
  const int count = count_text ? std::atoi(count_text) : 3;
  const std::uint64_t first = seed_text ? std::strtoull(seed_text, nullptr, 10) : std::random_device{}();
  int failed = 0, with_change = 0, redone = 0;
  double worst[2] = {0, 0};  // SGD, AdamW: the largest distance to the uninterrupted run
  for (int i = 0; i < count; ++i) {
    const Trial t = draw(first + static_cast<std::uint64_t>(i));
    std::printf("trial %d, %s: ", i + 1, t.text().c_str());  // named before it runs: a throw may end it
    std::fflush(stdout);
    const Outcome o = run_trial(t);
    std::printf("%s (%zu membership changes%s, parameters %.3g off)\n", o.wrong.empty() ? "ok" : "FAILED", o.changes,
                o.redone ? ", a step's epilogue completed" : "", o.difference);
    std::fflush(stdout);
    EXPECT_EQ(o.wrong, "") << t.text() << " (replay: LOCKSTEP_TRIAL_SEED=" << t.seed << " LOCKSTEP_ELASTIC_TRIALS=1)";
    failed += !o.wrong.empty();
    with_change += o.changes > 0;
    redone += o.redone;
    worst[t.adamw] = std::max(worst[t.adamw], o.difference);
  }
  std::printf("elastic trials: %d, %d passed, %d failed; %d changed membership, %d completed a step's epilogue on a "
              "new membership\n",
              count, count - failed, failed, with_change, redone);
  for (bool adamw : {false, true})
    std::printf("  %s: largest parameter difference %.3g (tolerance %.3g; uninterrupted 2 vs 3 workers %.3g)\n",
                adamw ? "adamw" : "sgd", worst[adamw], reference(adamw).tolerance, reference(adamw).two_versus_three);
}

}  // namespace
}  // namespace lockstep::testing
