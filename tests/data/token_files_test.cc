// Token files (lockstep/data/token_files.h) read back from real files that the tests write.
//
// The bytes come from the formats' definitions, written here byte by byte (little-endian, each
// .idx field in its place), not through the reader's code; broken files break one field at a
// time. One test also has an independent program write them: Python's struct and array modules
// (Debian's /usr/bin/python3, which has no numpy) write a nanoGPT-style uint16 file and a Megatron
// dataset; the test skips, saying why, where there is no /usr/bin/python3.
#include "lockstep/data/token_files.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <random>
#include <thread>

#include "lockstep/error.h"
#include "testing.h"

namespace lockstep::data {
namespace {

// v's low `bytes` bytes, least significant first.
void put(std::string& out, std::uint64_t v, std::size_t bytes) {
  for (std::size_t k = 0; k < bytes; ++k) out.push_back(static_cast<char>((v >> (8 * k)) & 0xffu));
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string token_bytes_of(const std::vector<std::int64_t>& tokens, std::size_t width) {
  std::string out;
  for (const auto t : tokens) put(out, static_cast<std::uint64_t>(t), width);
  return out;
}

// Megatron's dtype codes and their widths: 1 uint8, 4 int32, 5 int64, 8 uint16.
std::size_t width_of_code(std::uint8_t code) {
  return code == 1 ? 1 : code == 4 ? 4 : code == 5 ? 8 : 2;
}

// An indexed dataset as fields; a test changes one, then writes prefix.idx and prefix.bin.
struct Indexed {
  std::string magic = std::string("MMIDIDX\0\0", 9);
  std::uint64_t version = 1;
  std::uint8_t dtype = 8;
  std::vector<std::int32_t> sizes;
  std::vector<std::int64_t> pointers;  // byte offsets: the running sums of sizes x width
  std::vector<std::int64_t> doc_idx;
  std::uint64_t sequence_count = 0, document_count = 0;  // S and D as written
  std::string bin;

  Indexed(const std::vector<std::vector<std::int64_t>>& sequences, std::vector<std::int64_t> documents,
          std::uint8_t code = 8)
      : dtype(code), doc_idx(std::move(documents)) {
    for (const auto& s : sequences) {
      pointers.push_back(static_cast<std::int64_t>(bin.size()));
      sizes.push_back(static_cast<std::int32_t>(s.size()));
      bin += token_bytes_of(s, width_of_code(code));
    }
    sequence_count = sizes.size();
    document_count = doc_idx.size();
  }

  std::string idx() const {
    std::string out = magic;
    put(out, version, 8);
    put(out, dtype, 1);
    put(out, sequence_count, 8);
    put(out, document_count, 8);
    for (const auto s : sizes) put(out, static_cast<std::uint32_t>(s), 4);
    for (const auto p : pointers) put(out, static_cast<std::uint64_t>(p), 8);
    for (const auto d : doc_idx) put(out, static_cast<std::uint64_t>(d), 8);
    return out;
  }

  std::string write(const std::string& prefix) const {
    write_file(prefix + ".idx", idx());
    write_file(prefix + ".bin", bin);
    return prefix;
  }
};

// Four sequences (one empty) in two documents: 1 2 3 4 | 5 6 7 8. With uint16, the sizes are at
// byte offsets 34, 38, 42, 46, the pointers (0, 6, 8, 8) at 50, 58, 66, 74, doc_idx at 82, 90, 98.
Indexed two_documents(std::uint8_t code = 8) {
  return Indexed({{1, 2, 3}, {4}, {}, {5, 6, 7, 8}}, {0, 2, 4}, code);
}

std::vector<std::int64_t> all_tokens(const TokenFile& f) {
  std::vector<std::int64_t> out(f.size());
  f.copy(0, f.size(), out.data());
  return out;
}

// The DataError's message, or "" when `open` threw none.
template <typename F>
std::string error_of(F&& open) {
  try {
    open();
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

// Every part of `parts` in `message`.
void expect_says(const std::string& message, const std::vector<std::string>& parts) {
  for (const auto& part : parts)
    EXPECT_NE(message.find(part), std::string::npos) << "no \"" << part << "\" in: " << message;
}

std::string indexed_error(const Indexed& dataset, const std::string& prefix) {
  dataset.write(prefix);
  return error_of([&] { TokenFile::open_indexed(prefix); });
}

TEST(TokenFile, AFlatUint16FileIsNanoGptsArray) {
  testing::TempDir dir("tokens");
  const std::vector<std::int64_t> tokens = {50256, 0, 1, 65535, 464, 2068, 7586, 50256};
  write_file(dir / "train.bin", token_bytes_of(tokens, 2));
  const TokenFile f = TokenFile::open_flat(dir / "train.bin", TokenWidth::u16);
  EXPECT_EQ(f.path(), dir / "train.bin");
  EXPECT_EQ(f.type(), TokenType::u16);
  EXPECT_EQ(all_tokens(f), tokens);
  EXPECT_EQ(f.at(3), 65535);
  EXPECT_EQ(f.documents(), 1u);
  EXPECT_EQ(f.document(0).first, 0u);
  EXPECT_EQ(f.document(0).count, tokens.size());
}

TEST(TokenFile, AFlatUint32FileHoldsTokensBeyond65535) {
  testing::TempDir dir("tokens");
  const std::vector<std::int64_t> tokens = {65536, 100276, 0, 4294967295};
  write_file(dir / "train.bin", token_bytes_of(tokens, 4));
  const TokenFile f = TokenFile::open_flat(dir / "train.bin", TokenWidth::u32);
  EXPECT_EQ(f.type(), TokenType::u32);
  EXPECT_EQ(all_tokens(f), tokens);
  EXPECT_EQ(token_bytes(f.type()), 4u);
}

TEST(TokenFile, TheFlatWidthFollowsTheVocabulary) {
  EXPECT_EQ(token_width_for(50257), TokenWidth::u16);  // GPT-2's
  EXPECT_EQ(token_width_for(65536), TokenWidth::u16);
  EXPECT_EQ(token_width_for(65537), TokenWidth::u32);
  EXPECT_EQ(token_width_for(100277), TokenWidth::u32);  // cl100k's
  EXPECT_THROW(token_width_for(0), ConfigError);
  EXPECT_THROW(token_width_for((std::uint64_t{1} << 32) + 1), ConfigError);
}

TEST(TokenFile, AnIndexedDatasetIsItsSequencesBackToBackInEveryDtype) {
  testing::TempDir dir("tokens");
  for (const std::uint8_t code : {1, 4, 5, 8}) {
    const TokenFile f = TokenFile::open_indexed(two_documents(code).write(dir / "corpus"));
    EXPECT_EQ(token_bytes(f.type()), width_of_code(code)) << token_type_name(f.type());
    EXPECT_EQ(f.path(), dir / "corpus.bin");
    EXPECT_EQ(all_tokens(f), (std::vector<std::int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
    ASSERT_EQ(f.documents(), 2u);
    EXPECT_EQ(f.document(0).first, 0u);
    EXPECT_EQ(f.document(0).count, 4u);
    EXPECT_EQ(f.document(1).first, 4u);
    EXPECT_EQ(f.document(1).count, 4u);
  }
  const std::int64_t big = std::int64_t{1} << 40;
  const TokenFile wide = TokenFile::open_indexed(Indexed({{big, -2}}, {0, 1}, 5).write(dir / "wide"));
  EXPECT_EQ(all_tokens(wide), (std::vector<std::int64_t>{big, -2}));
  const TokenFile signed32 =
      TokenFile::open_indexed(Indexed({{-1, 2147483647}}, {0, 1}, 4).write(dir / "i32"));
  EXPECT_EQ(all_tokens(signed32), (std::vector<std::int64_t>{-1, 2147483647}));
}

TEST(TokenFile, BlocksAreNonOverlappingWindowsWithTheirNextTokenTargets) {
  testing::TempDir dir("tokens");
  std::vector<std::int64_t> tokens(100);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int64_t>(i * 7 % 1000);
  write_file(dir / "train.bin", token_bytes_of(tokens, 2));
  const TokenFileBlocks blocks = TokenFile::open_flat(dir / "train.bin", TokenWidth::u16).blocks(8);
  ASSERT_EQ(blocks.size(), 12u);  // (100 - 1) / 8: tokens 97..99 are dropped
  EXPECT_EQ(blocks.block_size(), 8);
  std::vector<std::int64_t> block(9);
  for (std::size_t i = 0; i < blocks.size(); ++i) {
    blocks.copy(i, block.data());
    EXPECT_EQ(block, std::vector<std::int64_t>(tokens.begin() + 8 * i, tokens.begin() + 8 * i + 9))
        << "block " << i;
  }
  std::vector<std::int64_t> inputs(3 * 8), targets(3 * 8);
  blocks.copy_batch({11, 0, 4}, inputs.data(), targets.data());
  for (std::size_t j = 0; j < 8; ++j) {
    EXPECT_EQ(inputs[j], tokens[88 + j]);
    EXPECT_EQ(targets[j], tokens[89 + j]);
    EXPECT_EQ(inputs[8 + j], tokens[j]);
    EXPECT_EQ(targets[16 + j], tokens[33 + j]);
  }
  write_file(dir / "nine.bin", token_bytes_of(std::vector<std::int64_t>(9, 5), 2));
  EXPECT_EQ(TokenFile::open_flat(dir / "nine.bin", TokenWidth::u16).blocks(8).size(), 1u);  // exactly T + 1
}

TEST(TokenFile, AnIndexedDatasetsBlocksRunAcrossSequencesAndDocuments) {
  testing::TempDir dir("tokens");
  const TokenFileBlocks blocks = TokenFile::open_indexed(two_documents().write(dir / "corpus")).blocks(3);
  ASSERT_EQ(blocks.size(), 2u);  // (8 - 1) / 3
  std::vector<std::int64_t> block(4);
  blocks.copy(0, block.data());
  EXPECT_EQ(block, (std::vector<std::int64_t>{1, 2, 3, 4}));
  blocks.copy(1, block.data());
  EXPECT_EQ(block, (std::vector<std::int64_t>{4, 5, 6, 7}));
}

TEST(TokenFile, ManyThreadsReadOneMappingAtOnce) {
  testing::TempDir dir("tokens");
  const std::size_t n = std::size_t{1} << 20;
  auto token_at = [](std::size_t i) { return static_cast<std::int64_t>((i * 2654435761u) % 100277); };
  std::vector<std::int64_t> tokens(n);
  for (std::size_t i = 0; i < n; ++i) tokens[i] = token_at(i);
  write_file(dir / "train.bin", token_bytes_of(tokens, 4));
  auto blocks =
      std::make_unique<TokenFileBlocks>(TokenFile::open_flat(dir / "train.bin", TokenWidth::u32).blocks(64));
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  const std::uint64_t seed = testing::test_seed();
  for (int t = 0; t < 8; ++t)
    threads.emplace_back([&, t, mine = *blocks] {  // each thread its own copy, sharing the mapping
      std::mt19937_64 rng(seed + static_cast<std::uint64_t>(t));
      std::vector<std::int64_t> block(65);
      for (int k = 0; k < 2000; ++k) {
        const std::size_t i = rng() % mine.size();
        mine.copy(i, block.data());
        for (std::size_t j = 0; j < block.size(); ++j)
          if (block[j] != token_at(64 * i + j)) ++wrong;
      }
    });
  blocks.reset();  // the threads' copies keep the file mapped
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(wrong.load(), 0);
}

// The files as an independent program writes them: nanoGPT's flat file by array.tofile (numpy's
// tofile writes the same bytes), a Megatron dataset by struct.pack, field by field.
constexpr const char* kPythonWriter = R"(import array, struct, sys
d = sys.argv[1]
ids = [(i * 7919) % 50257 for i in range(1000)]
a = array.array('H', ids)
if sys.byteorder != 'little': a.byteswap()
with open(d + '/train.bin', 'wb') as f: a.tofile(f)
with open(d + '/corpus.bin', 'wb') as f: f.write(a.tobytes())
sizes = [10, 0, 390, 600]
pointers = [2 * sum(sizes[:i]) for i in range(len(sizes))]
docs = [0, 1, 3, 4]
with open(d + '/corpus.idx', 'wb') as f:
    f.write(b'MMIDIDX\x00\x00' + struct.pack('<QBQQ', 1, 8, len(sizes), len(docs)))
    f.write(struct.pack('<%di' % len(sizes), *sizes))
    f.write(struct.pack('<%dq' % len(pointers), *pointers))
    f.write(struct.pack('<%dq' % len(docs), *docs))
)";

TEST(TokenFile, FilesThatPythonWroteReadTheSame) {
  if (::access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "no /usr/bin/python3 to write the files";
  testing::TempDir dir("tokens");
  testing::Process python({"/usr/bin/python3", "-c", kPythonWriter, dir.path()});
  ASSERT_EQ(python.wait(60), 0) << python.output();
  std::vector<std::int64_t> ids(1000);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int64_t>(i * 7919 % 50257);
  EXPECT_EQ(all_tokens(TokenFile::open_flat(dir / "train.bin", TokenWidth::u16)), ids);
  const TokenFile corpus = TokenFile::open_indexed(dir / "corpus");
  EXPECT_EQ(all_tokens(corpus), ids);
  ASSERT_EQ(corpus.documents(), 3u);
  EXPECT_EQ(corpus.document(0).count, 10u);
  EXPECT_EQ(corpus.document(1).first, 10u);
  EXPECT_EQ(corpus.document(1).count, 390u);
  EXPECT_EQ(corpus.document(2).first, 400u);
  EXPECT_EQ(corpus.document(2).count, 600u);
  corpus.check_vocabulary(50257);
}

TEST(TokenFile, TheVocabularyCheckNamesTheFirstTokenOutside) {
  testing::TempDir dir("tokens");
  write_file(dir / "train.bin", token_bytes_of({1, 2, 50257, 3, 60000}, 2));
  const TokenFile f = TokenFile::open_flat(dir / "train.bin", TokenWidth::u16);
  expect_says(error_of([&] { f.check_vocabulary(50257); }),
              {dir / "train.bin", "byte offset 4", "token 2 is 50257", "vocabulary of 50257", "tokenize"});
  f.check_vocabulary(60001);
  const TokenFile negative = TokenFile::open_indexed(Indexed({{0, 5}, {-1}}, {0, 2}, 4).write(dir / "i32"));
  expect_says(error_of([&] { negative.check_vocabulary(100); }), {dir / "i32.bin", "byte offset 8", "is -1"});
}

TEST(TokenFile, AMissingFileIsNamed) {
  testing::TempDir dir("tokens");
  expect_says(error_of([&] { TokenFile::open_flat(dir / "absent.bin", TokenWidth::u16); }),
              {dir / "absent.bin", "cannot open", "nanoGPT"});
  write_file(dir / "only_bin.bin", "ab");
  expect_says(error_of([&] { TokenFile::open_indexed(dir / "only_bin"); }),
              {dir / "only_bin.idx", "cannot open", "P.idx and P.bin"});
  write_file(dir / "only_idx.idx", two_documents().idx());
  expect_says(error_of([&] { TokenFile::open_indexed(dir / "only_idx"); }),
              {dir / "only_idx.bin", "cannot open"});
  expect_says(error_of([&] { TokenFile::open_flat(dir.path(), TokenWidth::u16); }), {"not a regular file"});
}

TEST(TokenFile, AFlatFileOfPartTokensNamesItsSizeAndWidth) {
  testing::TempDir dir("tokens");
  write_file(dir / "odd.bin", std::string(7, 'x'));
  expect_says(error_of([&] { TokenFile::open_flat(dir / "odd.bin", TokenWidth::u16); }),
              {dir / "odd.bin", "byte offset 6", "holds 7 bytes", "2-byte uint16", "truncated"});
  write_file(dir / "ten.bin", std::string(10, 'x'));
  expect_says(error_of([&] { TokenFile::open_flat(dir / "ten.bin", TokenWidth::u32); }),
              {dir / "ten.bin", "byte offset 8", "holds 10 bytes", "4-byte uint32"});
}

TEST(TokenFile, AWrongMagicVersionOrDtypeIsRefused) {
  testing::TempDir dir("tokens");
  const std::string idx = dir / "p.idx";
  Indexed d = two_documents();
  d.magic[6] = 'Y';
  expect_says(indexed_error(d, dir / "p"), {idx, "byte offset 0", "magic is 4d 4d 49 44 49 44 59 00 00"});
  d = two_documents();
  d.version = 2;
  expect_says(indexed_error(d, dir / "p"), {idx, "byte offset 9", "version 2"});
  for (const auto& [code, name] : std::vector<std::pair<std::uint8_t, std::string>>{
           {7, "7 (float32)"}, {6, "6 (float64)"}, {3, "3 (int16)"}, {200, "200 (unknown)"}}) {
    d = two_documents();
    d.dtype = code;
    expect_says(indexed_error(d, dir / "p"), {idx, "byte offset 17", "dtype code " + name, "8 (uint16)"});
  }
  write_file(idx, two_documents().idx().substr(0, 20));
  expect_says(error_of([&] { TokenFile::open_indexed(dir / "p"); }),
              {idx, "byte offset 20", "header", "truncated"});
}

TEST(TokenFile, CountsThatDoNotFitTheFileAreRefusedBeforeUse) {
  testing::TempDir dir("tokens");
  const std::string idx = dir / "p.idx";
  for (const std::uint64_t huge : {std::uint64_t{1} << 62, ~std::uint64_t{0}, std::uint64_t{7}}) {
    Indexed d = two_documents();
    d.sequence_count = huge;
    expect_says(indexed_error(d, dir / "p"),
                {idx, "byte offset 18", "sequence count " + std::to_string(huge)});
  }
  Indexed d = two_documents();
  d.document_count = 4;  // one more than written
  expect_says(indexed_error(d, dir / "p"), {idx, "byte offset 26", "document count 4"});
  d.document_count = std::uint64_t{1} << 61;
  expect_says(indexed_error(d, dir / "p"), {idx, "byte offset 26", "truncated or corrupt"});
  d = two_documents();
  write_file(idx, d.idx() + std::string(4, '\0'));
  expect_says(error_of([&] { TokenFile::open_indexed(dir / "p"); }),
              {idx, "byte offset 106", "4 bytes follow the document index"});
}

TEST(TokenFile, BadSizesOrPointersAreRefused) {
  testing::TempDir dir("tokens");
  const std::string idx = dir / "p.idx";
  Indexed d = two_documents();
  d.sizes[1] = -1;
  expect_says(indexed_error(d, dir / "p"), {idx, "byte offset 38", "sequence 1 has a negative size, -1"});
  d = two_documents();
  d.pointers = {0, 6, 4, 8};
  expect_says(indexed_error(d, dir / "p"), {idx, "byte offset 66", "sequence 2", "out of order"});
  d.pointers = {0, 4, 8, 8};
  expect_says(indexed_error(d, dir / "p"), {idx, "byte offset 58", "pointer is 4, not 6", "token width 2"});
  d.pointers = {0, 6, 8, 100};
  expect_says(indexed_error(d, dir / "p"),
              {idx, "byte offset 74", "pointer 100 is outside " + dir / "p.bin"});
  d.pointers = {-2, 6, 8, 8};
  expect_says(indexed_error(d, dir / "p"), {idx, "byte offset 50", "pointer -2 is outside"});
}

TEST(TokenFile, ABadDocumentIndexIsRefused) {
  testing::TempDir dir("tokens");
  const std::string idx = dir / "p.idx";
  const std::vector<std::pair<std::vector<std::int64_t>, std::vector<std::string>>> cases = {
      {{1, 2, 4}, {"byte offset 82", "boundary 0 is sequence 1, not 0"}},
      {{0, 3, 2, 4}, {"byte offset 98", "boundary 2 is sequence 2, before the previous boundary, 3"}},
      {{0, 2, 5}, {"byte offset 98", "sequence 5, past the 4 sequences"}},
      {{0, 2, 3}, {"byte offset 98", "last document boundary is sequence 3, not the sequence count 4"}},
      {{}, {"byte offset 26", "document count is 0"}},
  };
  for (const auto& [doc_idx, says] : cases) {
    Indexed d = two_documents();
    d.doc_idx = doc_idx;
    d.document_count = doc_idx.size();
    const std::string message = indexed_error(d, dir / "p");
    expect_says(message, {idx});
    expect_says(message, says);
  }
}

TEST(TokenFile, ABinShorterOrLongerThanItsIndexIsRefused) {
  testing::TempDir dir("tokens");
  const std::string bin = dir / "p.bin";
  Indexed d = two_documents();
  d.bin.resize(14);
  expect_says(indexed_error(d, dir / "p"), {bin, "byte offset 14", "8 uint16 tokens, 16 bytes", "truncated"});
  d.bin.resize(4);  // sequence 1 now starts past the end
  expect_says(indexed_error(d, dir / "p"),
              {dir / "p.idx", "byte offset 58", "sequence 1", "outside " + bin, "truncated"});
  d = two_documents();
  d.bin += "xy";
  expect_says(indexed_error(d, dir / "p"), {bin, "byte offset 16", "2 bytes follow the last sequence"});
}

TEST(TokenFile, AnEmptyOrShortCorpusIsAClearError) {
  testing::TempDir dir("tokens");
  write_file(dir / "empty.bin", "");
  expect_says(error_of([&] { TokenFile::open_flat(dir / "empty.bin", TokenWidth::u16); }),
              {dir / "empty.bin", "holds no tokens"});
  expect_says(indexed_error(Indexed({}, {0}), dir / "none"), {dir / "none.bin", "holds no tokens"});
  write_file(dir / "eight.bin", token_bytes_of(std::vector<std::int64_t>(8, 1), 2));
  const TokenFile eight = TokenFile::open_flat(dir / "eight.bin", TokenWidth::u16);
  expect_says(error_of([&] { eight.blocks(8); }),
              {dir / "eight.bin", "holds 8 tokens", "one block of 8", "9 tokens"});
  EXPECT_THROW(eight.blocks(0), ConfigError);
}

TEST(TokenFile, ReadsPastTheEndAreConfigErrors) {
  testing::TempDir dir("tokens");
  const TokenFile f = TokenFile::open_indexed(two_documents().write(dir / "p"));
  std::vector<std::int64_t> out(8);
  EXPECT_THROW(f.at(8), ConfigError);
  EXPECT_THROW(f.copy(7, 2, out.data()), ConfigError);
  EXPECT_THROW(f.copy(~std::size_t{0}, 2, out.data()), ConfigError);  // first + count wraps
  EXPECT_THROW(f.document(2), ConfigError);
  EXPECT_THROW(f.blocks(3).copy(2, out.data()), ConfigError);
  std::vector<std::int64_t> inputs(3), targets(3);
  EXPECT_THROW(f.blocks(3).copy_batch({5}, inputs.data(), targets.data()), ConfigError);
}

}  // namespace
}  // namespace lockstep::data
