// The safetensors format, torch-free: what is written reads back byte for byte, in the layout
// Hugging Face's reader expects; every kind of damage is a DataError naming the file, never a crash.
// (That Python's safetensors package reads our files and we read its files: tests/python/test_gpt2.py.)
#include "lockstep/train_core/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <random>

#include "lockstep/error.h"
#include "testing.h"

namespace lockstep::train {
namespace {

template <typename T>
std::string raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// A 2 x 3 float matrix, a bf16 vector of 4 and an int64 scalar.
struct Fixture {
  std::string w = raw(std::vector<float>{1, 2, 3, 4, 5, 6.5f});
  std::string v = raw(std::vector<std::uint16_t>{0x3f80, 0x4000, 0x4040, 0x4080});
  std::string s = raw(std::vector<std::int64_t>{-7});
  std::vector<std::pair<std::string, SafeTensor>> tensors() const {
    return {{"w", {"F32", {2, 3}, w}}, {"v", {"BF16", {4}, v}}, {"s", {"I64", {}, s}}};
  }
};

std::uint64_t header_length(const std::string& file) {
  std::uint64_t n;
  std::memcpy(&n, file.data(), 8);  // little-endian hosts only run this suite
  return n;
}

TEST(Safetensors, WhatIsWrittenReadsBackWithItsMetadata) {
  Fixture f;
  testing::TempDir dir;
  const std::string path = dir.path() + "/m.safetensors";
  write_safetensors(path, f.tensors(), {{"format", "pt"}});
  const SafetensorsFile read = read_safetensors(path);
  ASSERT_EQ(read.tensors().size(), 3u);
  EXPECT_EQ(read.at("w").dtype, "F32");
  EXPECT_EQ(read.at("w").shape, (std::vector<std::int64_t>{2, 3}));
  EXPECT_EQ(read.at("w").bytes, f.w);
  EXPECT_EQ(read.at("v").bytes, f.v);
  EXPECT_EQ(read.at("s").shape.size(), 0u);
  EXPECT_EQ(read.at("s").numel(), 1);
  EXPECT_EQ(read.at("s").bytes, f.s);
  EXPECT_EQ(read.metadata().at("format"), "pt");
  EXPECT_FALSE(read.contains("x"));
}

TEST(Safetensors, TheHeaderIsPaddedSoTheDataStartsAlignedAndTensorsFollowInOrder) {
  Fixture f;
  const std::string file = encode_safetensors(f.tensors());
  const std::uint64_t n = header_length(file);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(file.size(), 8 + n + f.w.size() + f.v.size() + f.s.size());
  EXPECT_EQ(file.substr(8 + n, f.w.size()), f.w);  // the order given, no gaps
  EXPECT_EQ(file.substr(file.size() - f.s.size()), f.s);
}

TEST(Safetensors, AMissingTensorIsAnErrorNamingTheFileAndTheTensor) {
  Fixture f;
  const SafetensorsFile read(encode_safetensors(f.tensors()), "model.safetensors");
  try {
    read.at("lm_head.weight");
    FAIL() << "no error";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("model.safetensors"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("lm_head.weight"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, WritingRefusesBytesThatDoNotMatchTheShape) {
  EXPECT_THROW(encode_safetensors({{"w", {"F32", {2, 2}, std::string(12, '\0')}}}), ConfigError);
  EXPECT_THROW(encode_safetensors({{"w", {"Q4", {1}, std::string(1, '\0')}}}), DataError);
  EXPECT_THROW(encode_safetensors({{"__metadata__", {"U8", {1}, std::string(1, '\0')}}}), ConfigError);
}

// Replaces the header by `json` (kept at its length by padding).
std::string with_header(const std::string& json, const std::string& data) {
  std::string h = json;
  h.append((8 - h.size() % 8) % 8, ' ');
  std::string out(8, '\0');
  const std::uint64_t n = h.size();
  std::memcpy(out.data(), &n, 8);
  return out + h + data;
}

TEST(Safetensors, HeadersThatLieAreRefusedWithTheReason) {
  const std::string data(16, '\0');
  auto refused = [&](const std::string& json, const std::string& reason) {
    try {
      SafetensorsFile(with_header(json, data), "x.safetensors");
      ADD_FAILURE() << "accepted " << json;
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << json << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find("x.safetensors"), std::string::npos) << e.what();
    }
  };
  refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", "need 8");
  refused(R"({"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})", "truncated");
  refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", "truncated");
  refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          "share bytes");
  refused(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", "impossible shape");
  refused(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", "impossible shape");
  refused(R"({"a":{"dtype":"X","shape":[2],"data_offsets":[0,8]}})", "dtype 'X'");
  refused(R"({"a":{"dtype":"F32","shape":[2]}})", "malformed");
  refused(R"([1,2])", "not a JSON object");
  refused("{\"a\":", "malformed");
  // 2^61 doubles: a count that fits 64 bits whose bytes wrap to 0, which an unchecked product accepts.
  refused(R"({"a":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]},)"
          R"("b":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})",
          "overflow 64 bits");
  refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "8 bytes follow the last tensor");
  refused(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
          "bytes [4, 8) of the data belong to no tensor");
  refused(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
          "names 'a' twice");
}

TEST(Safetensors, AHeaderLengthBeyondTheFileIsRefused) {
  std::string file = encode_safetensors(Fixture().tensors());
  for (const std::uint64_t claimed : {std::uint64_t(file.size()), std::uint64_t(1) << 40, ~std::uint64_t(0)}) {
    std::memcpy(file.data(), &claimed, 8);
    try {
      SafetensorsFile(file, "long.safetensors");
      ADD_FAILURE() << "accepted a header length of " << claimed;
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find("its header claims " + std::to_string(claimed)), std::string::npos) << e.what();
    }
  }
}

// Damage anywhere: a cut at a random length is always a DataError; a random byte changed in the
// data reads (the header still holds); one changed in the header is a DataError or a header that
// still describes the data. Never a crash, never a view past the data.
TEST(Safetensors, RandomDamageIsAnErrorOrHarmlessNeverACrash) {
  Fixture f;
  const std::string good = encode_safetensors(f.tensors(), {{"format", "pt"}});
  const std::size_t data_start = 8 + header_length(good);
  std::mt19937_64 rng(testing::test_seed());
  for (int trial = 0; trial < 3000; ++trial) {
    std::string bad = good;
    const bool cut = trial % 2 == 0;
    const auto at = std::uniform_int_distribution<std::size_t>(0, good.size() - 1)(rng);
    if (cut)
      bad.resize(at);
    else
      bad[at] = static_cast<char>(bad[at] ^ std::uniform_int_distribution<int>(1, 255)(rng));
    try {
      const SafetensorsFile read(bad, "damaged");
      EXPECT_FALSE(cut) << "a file cut to " << at << " bytes read";
      std::size_t bytes = 0;
      for (const auto& entry : read.tensors()) bytes += entry.second.bytes.size();
      EXPECT_LE(bytes, bad.size() - data_start);
    } catch (const DataError& e) {
      EXPECT_TRUE(cut || at < data_start) << "a change at data byte " << at - data_start << ": " << e.what();
    }
  }
}

// Hugging Face's sharded layout: model.safetensors.index.json maps each tensor to its shard.
struct ShardedDir {
  Fixture f;
  testing::TempDir dir{"shards"};
  ShardedDir() {
    write_safetensors(dir.path() + "/a.safetensors", {f.tensors()[0]});
    write_safetensors(dir.path() + "/b.safetensors", {f.tensors()[1], f.tensors()[2]});
  }
  void index(const std::string& weight_map) const {
    std::ofstream(dir.path() + "/model.safetensors.index.json") << R"({"metadata": {}, "weight_map": )" << weight_map
                                                                   << "}";
  }
  void refused(const std::string& reason) const {
    try {
      SafetensorsDir read(dir.path());
      ADD_FAILURE() << "accepted; wanted an error with: " << reason;
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(reason), std::string::npos) << e.what();
    }
  }
};

TEST(SafetensorsDir, ShardsReadAsOneWhenTheIndexMapsEachTensorToItsShard) {
  ShardedDir d;
  d.index(R"({"w": "a.safetensors", "v": "b.safetensors", "s": "b.safetensors"})");
  const SafetensorsDir read(d.dir.path());
  ASSERT_EQ(read.tensors().size(), 3u);
  EXPECT_EQ(read.tensors().at("w")->bytes, d.f.w);
  EXPECT_EQ(read.tensors().at("s")->bytes, d.f.s);
}

TEST(SafetensorsDir, ABrokenIndexOrAMissingOrContradictingShardIsRefusedNamingIt) {
  ShardedDir d;
  d.refused("holds no model.safetensors");
  d.index(R"({"w": "a.safetensors", "v": "c.safetensors"})");
  d.refused("lists the shard c.safetensors, which is not in");
  d.index(R"({"w": "a.safetensors", "v": "a.safetensors"})");
  d.refused("maps 'v' to a.safetensors, which does not hold it");
  d.index(R"({"w": "../a.safetensors"})");
  d.refused("which is not a file beside it");
  d.index(R"({"w": 3})");
  d.refused("is not an index of safetensors shards");
  d.index(R"([])");
  d.refused("is not an index of safetensors shards");
  std::ofstream(d.dir.path() + "/model.safetensors.index.json") << "{\"weight_map\": {";
  d.refused("model.safetensors.index.json");
  write_safetensors(d.dir.path() + "/c.safetensors", {d.f.tensors()[0]});  // "w" again
  d.index(R"({"w": "a.safetensors", "v": "b.safetensors", "x": "c.safetensors"})");
  d.refused("'w' is in both");
}

TEST(Safetensors, AFileThatIsNotThereIsAnErrorNamingIt) {
  EXPECT_THROW(read_safetensors("/nonexistent/model.safetensors"), DataError);
}

}  // namespace
}  // namespace lockstep::train
