// The sharded checkpoint format, torch-free: shards written by one world size read back at
// another, piece by piece; and every kind of damage a clear DataError naming the file.
#include "lockstep/train_core/shard_files.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <numeric>

#include "lockstep/error.h"
#include "testing.h"

namespace lockstep::train {
namespace {

namespace fs = std::filesystem;

// Two tensors (a 6 x 5 matrix and a vector of 7) and a buffer of 3 int64, their values 0, 1, ...
// and an "exp_avg" of value x 10, cut over `world` writers at arbitrary places.
struct Fixture {
  std::vector<CheckpointTensor> tensors{
      {"w", {6, 5}, "float32", false}, {"b", {7}, "float32", false}, {"stats", {3}, "int64", true}};
  std::vector<std::vector<float>> values, moments;
  std::vector<std::int64_t> stats{11, 12, 13};
  Fixture() {
    for (int t = 0; t < 2; ++t) {
      values.emplace_back(std::size_t(tensors[std::size_t(t)].numel()));
      std::iota(values.back().begin(), values.back().end(), 100.0f * float(t));
      moments.push_back(values.back());
      for (auto& m : moments.back()) m *= 10;
    }
  }
  // Writer r of `world` takes an uneven cut of each float tensor; writer 0 also the buffer.
  std::vector<ShardPiece> pieces_of(int r, int world) const {
    std::vector<ShardPiece> out;
    for (int t = 0; t < 2; ++t) {
      const std::int64_t n = tensors[std::size_t(t)].numel();
      const std::int64_t lo = n * r / world + (r > 0 ? 1 : 0),
                         hi = n * (r + 1) / world + (r + 1 < world ? 1 : 0);
      if (lo >= hi) continue;
      out.push_back({t,
                     lo,
                     hi - lo,
                     {{"value", values[std::size_t(t)].data() + lo},
                      {"exp_avg", moments[std::size_t(t)].data() + lo}}});
    }
    if (r == 0) out.push_back({2, 0, 3, {{"value", stats.data()}}});
    return out;
  }
  void write(const std::string& dir, int world) const {
    std::vector<nlohmann::json> shards;
    for (int r = 0; r < world; ++r)
      shards.push_back(
          write_shard_file(dir + "/shard-" + std::to_string(r) + "-of-" + std::to_string(world) + ".bin",
                           tensors, pieces_of(r, world)));
    std::ofstream(dir + "/index.json") << sharded_index(tensors, shards, {{"step", 42}});
  }
};

TEST(ShardedCheckpoint, ShardsOfAnyWorldReadBackAnyRange) {
  Fixture f;
  for (int world : {1, 2, 3, 5}) {
    testing::TempDir dir("sharded");
    f.write(dir.path(), world);
    ShardedCheckpointReader reader(dir.path());
    EXPECT_EQ(reader.world(), world);
    EXPECT_EQ(reader.extra()["step"], 42);
    ASSERT_EQ(reader.find("b"), 1);
    EXPECT_EQ(reader.find("nope"), -1);
    std::vector<float> w(30), m(30), b(5);
    reader.read(0, "value", 0, 30, w.data());
    reader.read(0, "exp_avg", 0, 30, m.data());
    reader.read(1, "value", 2, 5, b.data());
    EXPECT_EQ(w, f.values[0]) << world;
    EXPECT_EQ(m, f.moments[0]) << world;
    EXPECT_EQ(b, std::vector<float>(f.values[1].begin() + 2, f.values[1].end())) << world;
    std::vector<std::int64_t> stats(3);
    reader.read(2, "value", 0, 3, stats.data());
    EXPECT_EQ(stats, f.stats);
    EXPECT_TRUE(reader.has(0, "exp_avg"));
    EXPECT_FALSE(reader.has(2, "exp_avg"));
  }
}

void expect_data_error(const std::string& dir, const std::string& needle) {
  try {
    ShardedCheckpointReader reader(dir);
    std::vector<float> w(30);
    reader.read(0, "value", 0, 30, w.data());
    ADD_FAILURE() << "no error; expected one saying " << needle;
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(ShardedCheckpoint, DamageIsADataErrorNamingTheFile) {
  Fixture f;
  testing::TempDir dir("sharded-damage");
  f.write(dir.path(), 2);
  const std::string shard = dir / "shard-0-of-2.bin";
  {  // one flipped byte
    std::fstream io(shard, std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(8);
    io.put('\x7f');
  }
  expect_data_error(dir.path(), "shard-0-of-2.bin does not match its CRC-32");
  fs::resize_file(shard, 16);
  expect_data_error(dir.path(), "shard-0-of-2.bin holds 16 bytes where the index says");
  fs::remove(shard);
  expect_data_error(dir.path(), "shard-0-of-2.bin");
  std::ofstream(dir / "index.json") << "{\"format\": \"something else\", \"version\": 1}";
  expect_data_error(dir.path(), "is not a lockstep sharded checkpoint");
}

// An index whose numbers lie (damaged, or written by something else) is refused before anything
// is read through it: each lie below once made the reader throw a JSON library's exception or read
// outside a shard (found by tests/fuzz/checkpoint_index_fuzz.cc).
TEST(ShardedCheckpoint, AnIndexThatLiesIsADataErrorBeforeAnyRead) {
  Fixture f;
  testing::TempDir dir("sharded-lies");
  f.write(dir.path(), 1);
  const std::string path = dir / "index.json";
  nlohmann::json good;
  std::ifstream(path) >> good;
  auto expect_refused = [&](const std::function<void(nlohmann::json&)>& lie, const std::string& needle) {
    nlohmann::json index = good;
    lie(index);
    std::ofstream(path) << index.dump();
    expect_data_error(dir.path(), needle);
  };
  const auto piece0 = [](nlohmann::json& j) -> nlohmann::json& { return j["shards"][0]["pieces"][0]; };
  expect_refused([&](auto& j) { piece0(j)["offsets"]["value"] = std::uint64_t(-8); }, "lies outside its shard's");
  expect_refused([&](auto& j) { piece0(j)["count"] = 31; }, "lies outside its 30 elements");
  expect_refused([&](auto& j) { piece0(j)["start"] = -1; }, "lies outside its 30 elements");
  expect_refused([&](auto& j) { piece0(j)["tensor"] = 9; }, "names tensor 9 of the 3 it lists");
  expect_refused([&](auto& j) { j["tensors"][0]["shape"] = {-2, 3}; }, "negative dimension");
  expect_refused([&](auto& j) { j["tensors"][0]["shape"] = {1 << 30, 1 << 30, 1 << 30}; }, "implausibly large");
  expect_refused([&](auto& j) { j["shards"][0]["file"] = "../elsewhere.bin"; }, "not a plain file name");
  expect_refused([&](auto& j) { j["shards"][0]["file"] = 5; }, "of the wrong type");
  expect_refused([&](auto& j) { j["version"] = "1"; }, "is not a lockstep sharded checkpoint");
}

// The standard check value, so that any CRC-32C implementation verifies our shards.
TEST(ShardedCheckpoint, TheChecksumIsCrc32c) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  std::string long_text(1000, 'x');
  EXPECT_NE(crc32c(long_text.data(), 1000), crc32c(long_text.data(), 999));
}

// Large buffers are checksummed as three interleaved streams joined afterwards: every length,
// around the sizes where the split starts and with a tail that is not a multiple of 8, must give
// what the plain bit-at-a-time definition gives.
TEST(ShardedCheckpoint, TheChecksumOfLongBuffersIsTheDefinitionsWhateverTheLength) {
  auto by_definition = [](const unsigned char* p, std::size_t n) {
    std::uint32_t crc = 0xffffffffu;
    for (std::size_t i = 0; i < n; ++i) {
      crc ^= p[i];
      for (int k = 0; k < 8; ++k) crc = (crc & 1) ? (crc >> 1) ^ 0x82f63b78u : crc >> 1;
    }
    return ~crc;
  };
  std::vector<unsigned char> bytes((1u << 20) + 13);
  std::uint32_t x = 12345;
  for (auto& b : bytes) b = static_cast<unsigned char>((x = x * 1103515245u + 12345u) >> 24);
  for (std::size_t n : {std::size_t{0}, std::size_t{9}, std::size_t{12287}, std::size_t{12288},
                        std::size_t{12300}, std::size_t{24583}, std::size_t{100001}, bytes.size()})
    EXPECT_EQ(crc32c(bytes.data(), n), by_definition(bytes.data(), n)) << n << " bytes";
}

TEST(ShardedCheckpoint, ARangeNobodyWroteIsNamed) {
  Fixture f;
  testing::TempDir dir("sharded-gap");
  const auto pieces = f.pieces_of(1, 2);  // only the second writer's pieces
  std::vector<nlohmann::json> shards{write_shard_file(dir / "shard-1-of-2.bin", f.tensors, pieces)};
  std::ofstream(dir / "index.json") << sharded_index(f.tensors, shards, {});
  expect_data_error(dir.path(), "has no 'value' for elements 0.. of 'w'");
}

TEST(ShardedCheckpoint, AWriteThatFailsNamesThePath) {
  Fixture f;
  try {
    write_shard_file("/nonexistent-dir/shard.bin", f.tensors, f.pieces_of(0, 1));
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/shard.bin"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lockstep::train
