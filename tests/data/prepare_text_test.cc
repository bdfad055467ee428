// Text files into token files (lockstep/data/prepare_text.h), with a tokenizer of the test's own
// (each byte is a token, shifted by one so that 0 is free) and with a SentencePiece model that
// Debian's spm_train trains on a fortune file here; the files are read back with TokenFile.
#include "lockstep/data/prepare_text.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>

#include "lockstep/data/sentencepiece.h"
#include "lockstep/data/text.h"
#include "lockstep/data/token_files.h"
#include "lockstep/error.h"
#include "testing.h"

namespace lockstep::data {
namespace {

void write_text(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// Byte b becomes token b + 1; token 0 ends documents.
TextEncoder shifted_bytes(std::uint64_t vocabulary = 257) {
  return {[](std::string_view line) {
            std::vector<std::int64_t> ids;
            for (unsigned char c : line) ids.push_back(c + 1);
            return ids;
          },
          0, vocabulary};
}

std::vector<std::int64_t> read_back(const std::string& path, std::uint64_t vocabulary) {
  const TokenFile file = TokenFile::open_flat(path, token_width_for(vocabulary));
  std::vector<std::int64_t> tokens(file.size());
  file.copy(0, tokens.size(), tokens.data());
  return tokens;
}

TEST(PrepareText, LinesAreEncodedAndEachDocumentEndsWithItsToken) {
  testing::TempDir dir("prepare");
  write_text(dir / "a.txt", "ab\n%\nc\n%\n%\n");  // two documents, then an empty one (not written)
  write_text(dir / "b.txt", "d\ne");               // a file's end closes a document, no newline needed
  const PreparedText done =
      prepare_token_file(shifted_bytes(), {dir / "a.txt", dir / "b.txt"}, "%", dir / "out.bin");
  const std::vector<std::int64_t> expected{'a' + 1, 'b' + 1, 0, 'c' + 1, 0, 'd' + 1, 'e' + 1, 0};
  EXPECT_EQ(read_back(dir / "out.bin", 257), expected);
  EXPECT_EQ(done.tokens, expected.size());
  EXPECT_EQ(done.documents, 3u);
  EXPECT_EQ(done.lines, 7u);
  EXPECT_EQ(done.token_bytes, 2);
}

TEST(PrepareText, WithoutASeparatorEachFileIsOneDocument) {
  testing::TempDir dir("prepare");
  write_text(dir / "a.txt", "x\n%\ny\n");
  prepare_token_file(shifted_bytes(), {dir / "a.txt"}, "", dir / "out.bin");
  EXPECT_EQ(read_back(dir / "out.bin", 257), (std::vector<std::int64_t>{'x' + 1, '%' + 1, 'y' + 1, 0}));
}

TEST(PrepareText, AVocabularyAboveUint16TakesFourBytesATokenAndReadsBack) {
  testing::TempDir dir("prepare");
  write_text(dir / "a.txt", "hi\n");
  TextEncoder big = shifted_bytes(70000);
  big.encode = [](std::string_view line) {
    std::vector<std::int64_t> ids;
    for (unsigned char c : line) ids.push_back(66000 + c);  // above what uint16 holds
    return ids;
  };
  const PreparedText done = prepare_token_file(big, {dir / "a.txt"}, "", dir / "out.bin");
  EXPECT_EQ(done.token_bytes, 4);
  EXPECT_EQ(std::filesystem::file_size(dir / "out.bin"), 3u * 4u);
  EXPECT_EQ(read_back(dir / "out.bin", 70000), (std::vector<std::int64_t>{66000 + 'h', 66000 + 'i', 0}));
}

// Bad input: an error naming the problem, and no output file, not even a partial one.
TEST(PrepareText, AnUnreadableFileOrATokenOutsideTheVocabularyLeavesNoFile) {
  testing::TempDir dir("prepare");
  write_text(dir / "a.txt", "fine\n");
  EXPECT_THROW(
      {
        try {
          prepare_token_file(shifted_bytes(), {dir / "a.txt", dir / "missing.txt"}, "", dir / "out.bin");
        } catch (const DataError& e) {
          EXPECT_NE(std::string(e.what()).find("missing.txt: cannot read"), std::string::npos) << e.what();
          throw;
        }
      },
      DataError);
  write_text(dir / "b.txt", "ok\n\xff\n");
  try {
    prepare_token_file(shifted_bytes(200), {dir / "b.txt"}, "", dir / "out.bin");
    ADD_FAILURE() << "a token of 256 in a vocabulary of 200 was written";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("b.txt, line 2: the tokenizer gave token 256"), std::string::npos)
        << e.what();
  }
  for (const auto& entry : std::filesystem::directory_iterator(dir.path()))
    EXPECT_NE(entry.path().filename().string().rfind("out.bin", 0), 0u) << entry.path();
}

// A SentencePiece model trained here by Debian's spm_train on a fortune file.
class SentencePieceModel : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!sentencepiece_built()) GTEST_SKIP() << "built without libsentencepiece-dev";
    if (!std::filesystem::exists("/usr/bin/spm_train"))
      GTEST_SKIP() << "no /usr/bin/spm_train (Debian's sentencepiece)";
    corpus_ = std::string(kFortunesDir) + "/literature";
    testing::Process train({"/usr/bin/spm_train", "--input=" + corpus_, "--model_prefix=" + (dir_ / "m"),
                            "--vocab_size=400", "--model_type=bpe", "--minloglevel=2"});
    ASSERT_EQ(train.wait(120), 0) << train.output();
  }
  testing::TempDir dir_{"spm"};
  std::string corpus_;
};

TEST_F(SentencePieceModel, EncodesAsSpmEncodeAndDecodesBack) {
  const SentencePiece sp(dir_ / "m.model");
  EXPECT_EQ(sp.vocabulary(), 400u);
  EXPECT_GE(sp.end_of_sentence(), 0);
  const std::string line = "The quick brown fox reads a fortune.";
  const auto ids = sp.encode(line);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(sp.decode(ids), line);
  // Debian's command-line encoder, line by line, as prepare_token_file reads.
  write_text(dir_ / "line.txt", line + "\n");
  testing::Process encode({"/usr/bin/spm_encode", "--model=" + (dir_ / "m.model"), "--output_format=id",
                           "--input=" + (dir_ / "line.txt")});
  ASSERT_EQ(encode.wait(60), 0) << encode.output();
  std::string expected;
  for (auto id : ids) expected += (expected.empty() ? "" : " ") + std::to_string(id);
  EXPECT_EQ(encode.output(), expected + "\n");
  EXPECT_THROW(sp.decode({400}), DataError);
}

TEST_F(SentencePieceModel, PreparesAFortuneFileThatReadsBackAsItsLinesTokens) {
  const SentencePiece sp(dir_ / "m.model");
  const PreparedText done = prepare_token_file(sp.encoder(), {corpus_}, "%", dir_ / "out.bin");
  const auto tokens = read_back(dir_ / "out.bin", sp.vocabulary());
  EXPECT_EQ(tokens.size(), done.tokens);
  EXPECT_GT(done.documents, 100u);  // a fortune file holds hundreds of entries
  EXPECT_EQ(static_cast<std::uint64_t>(std::count(tokens.begin(), tokens.end(), sp.end_of_sentence())),
            done.documents);
  std::ifstream in(corpus_);
  std::string first_line;
  std::getline(in, first_line);
  const auto first = sp.encode(first_line);
  ASSERT_LE(first.size(), tokens.size());
  EXPECT_TRUE(std::equal(first.begin(), first.end(), tokens.begin())) << first_line;
}

TEST(SentencePiece, AFileThatIsNoModelIsAnErrorNamingIt) {
  if (!sentencepiece_built()) GTEST_SKIP() << "built without libsentencepiece-dev";
  testing::TempDir dir("spm");
  write_text(dir / "not.model", "plain text\n");
  try {
    SentencePiece sp(dir / "not.model");
    ADD_FAILURE() << "a text file was read as a model";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("not.model: not a SentencePiece model"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lockstep::data
