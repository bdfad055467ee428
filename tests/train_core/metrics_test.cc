// metrics.jsonl: records round-trip through JSON, a reader copes with a run killed mid-line,
// and docs/metrics.md lists exactly the keys the code writes.
#include "lockstep/train_core/metrics.h"

#include <gtest/gtest.h>

#include <fstream>

#include "lockstep/error.h"
#include "lockstep/train_core/durable_file.h"
#include "testing.h"

using namespace lockstep;
using namespace lockstep::train;

TEST(Metrics, RecordsRoundTripAndOptionalFieldsAreLeftOutWhenAbsent) {
  metrics::StepLog log;
  log.step = 40;
  log.loss = 0.25;
  log.exposed_comm_seconds = 0.003;
  nlohmann::json j = log.to_json();
  EXPECT_EQ(j["event"], "log");
  EXPECT_FALSE(j.contains("grad_norm"));
  log.grad_norm = 1.5;
  j = log.to_json();
  const auto back = metrics::StepLog::from_json(j);
  EXPECT_EQ(back.step, 40);
  EXPECT_EQ(back.loss, 0.25);
  EXPECT_EQ(back.exposed_comm_seconds, 0.003);
  ASSERT_TRUE(back.grad_norm.has_value());
  EXPECT_EQ(*back.grad_norm, 1.5);
}

TEST(Metrics, EachStartIsASegmentAndACutLastLineIsSkipped) {
  lockstep::testing::TempDir dir("metrics");
  metrics::TrainBegin begin;
  begin.world_size = 2;
  metrics::StepLog log;
  log.step = 10;
  metrics::EvalLog eval;
  eval.step = 10;
  eval.eval_loss = 0.5;
  {
    std::ofstream out(dir / "metrics.jsonl");
    out << begin.to_json().dump() << "\n" << log.to_json().dump() << "\n" << eval.to_json().dump() << "\n";
    begin.start_step = 10;
    out << begin.to_json().dump() << "\n" << log.to_json().dump() << "\n";
    out << "{\"event\":\"log\",\"step\":2";  // the process was killed while writing
  }
  const auto segments = metrics::read_metrics(dir / "metrics.jsonl");
  ASSERT_EQ(segments.size(), 2u);
  EXPECT_EQ(segments[0].logs.size(), 1u);
  EXPECT_EQ(segments[0].evals.size(), 1u);
  EXPECT_EQ(segments[0].evals[0].eval_loss, 0.5);
  ASSERT_TRUE(segments[1].begin.has_value());
  EXPECT_EQ(segments[1].begin->start_step, 10);
  EXPECT_EQ(segments[1].logs.size(), 1u);
}

TEST(Metrics, ADamagedLineInTheMiddleIsAnErrorNamingFileAndLine) {
  lockstep::testing::TempDir dir("metrics");
  std::ofstream(dir / "metrics.jsonl")
      << "{\"event\":\"log\",\"step\":1}\nnot json\n{\"event\":\"log\",\"step\":2}\n";
  try {
    metrics::read_metrics(dir / "metrics.jsonl");
    FAIL() << "read a damaged file";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("metrics.jsonl:2"), std::string::npos) << e.what();
  }
}

// An integer field given a fraction, or a number no integer of its type holds, is an error naming
// the line and the key: the JSON library would have cast it, undefined behaviour (found by
// tests/fuzz/metrics_fuzz.cc). Whole numbers written as floats still read.
TEST(Metrics, ANumberAnIntegerFieldCannotHoldIsAnErrorNamingLineAndKey) {
  lockstep::testing::TempDir dir("metrics-numbers");
  for (const char* value : {"4.5", "4.44e30", "3000000000", "-1e300"}) {
    std::ofstream(dir / "metrics.jsonl") << "{\"event\":\"log\",\"step\":1}\n{\"event\":\"train_begin\",\"world_size\":"
                                         << value << "}\n{\"event\":\"log\",\"step\":2}\n";
    try {
      metrics::read_metrics(dir / "metrics.jsonl");
      ADD_FAILURE() << "world_size " << value << " was read";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("metrics.jsonl:2: 'world_size' is"), std::string::npos) << e.what();
    }
  }
  std::ofstream(dir / "metrics.jsonl") << "{\"event\":\"train_begin\",\"world_size\":4.0}\n";
  EXPECT_EQ(metrics::read_metrics(dir / "metrics.jsonl").at(0).begin->world_size, 4);
}

TEST(Metrics, TheDocsListExactlyTheKeysTheCodeWrites) {
  const std::string doc = lockstep::testing::read_file(LOCKSTEP_SOURCE_DIR "/docs/metrics.md");
  const auto a = doc.find("<!-- metrics:begin -->"), b = doc.find("<!-- metrics:end -->");
  ASSERT_NE(a, std::string::npos);
  ASSERT_NE(b, std::string::npos);
  std::string table = doc.substr(a + std::string("<!-- metrics:begin -->").size(), b - a - 22);
  while (!table.empty() && table.front() == '\n') table.erase(0, 1);
  EXPECT_EQ(table, metrics::markdown())
      << "docs/metrics.md is out of date: replace the text between its markers with the output of "
         "`build/tools/lockstep metrics-format`";
}

// A number beyond every type the JSON library has is its out_of_range, not a parse error: still a
// DataError naming the file (found by tests/fuzz/checkpoint_index_fuzz.cc).
TEST(DurableFile, ANumberTooLargeForAnyTypeIsADataErrorNamingTheFile) {
  lockstep::testing::TempDir dir("json-number");
  std::ofstream(dir / "index.json") << "{\"version\": 525977e998}";
  try {
    read_json_file(dir / "index.json", "the index of a sharded checkpoint");
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(dir / "index.json"), std::string::npos) << e.what();
  }
}

TEST(DurableFile, ADamagedJsonFileIsADataErrorNamingFileAndLine) {
  lockstep::testing::TempDir dir("json");
  std::ofstream(dir / "trainer_state.json") << "{\n  \"global_step\": 4,\n  \"epoch\": \n";
  try {
    read_json_file(dir / "trainer_state.json", "the trainer state of a checkpoint");
    FAIL();
  } catch (const DataError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(dir / "trainer_state.json"), std::string::npos) << what;
    EXPECT_NE(what.find("line 4"), std::string::npos) << what;
    EXPECT_EQ(what.find("json.exception"), std::string::npos) << what;
  }
}
