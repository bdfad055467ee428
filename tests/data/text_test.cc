// The fortune corpus as language-model blocks and as labelled entries: real files from Debian's
// fortunes packages.
#include "lockstep/data/text.h"

#include <gtest/gtest.h>

#include <set>

#include "lockstep/error.h"

namespace lockstep::data {
namespace {

const FortuneCorpus& corpus() {
  static const FortuneCorpus c;
  return c;
}

TEST(Fortunes, TheCorpusLoadsEveryCategoryAndEntry) {
  EXPECT_GE(corpus().categories().size(), 40u);
  EXPECT_GT(corpus().entries().size(), 15000u);
  std::size_t bytes = 0;
  for (const auto& e : corpus().entries()) {
    EXPECT_FALSE(e.text.empty());
    EXPECT_EQ(e.text.find("\n%\n"), std::string::npos) << e.category << ": an entry holds a separator";
    EXPECT_EQ(e.text.find('\0'), std::string::npos) << e.category << ": byte 0 pads, it must not occur";
    bytes += e.text.size();
  }
  EXPECT_GT(bytes, 2'000'000u);
  EXPECT_EQ(corpus().count("computers"), 1051u);  // as its strfile index says (the last entry has no closing %)
}

TEST(Fortunes, TheSplitIsByEntryAboutOneInTwentyAndNeverShared) {
  std::set<std::string> train, validation;
  for (const auto& e : corpus().entries()) (FortuneCorpus::in_validation(e.text) ? validation : train).insert(e.text);
  const double share = static_cast<double>(validation.size()) / static_cast<double>(train.size() + validation.size());
  EXPECT_GT(share, 0.03);
  EXPECT_LT(share, 0.07);
  for (const auto& t : validation) EXPECT_EQ(train.count(t), 0u) << "an entry is in both splits";
  EXPECT_EQ(FortuneCorpus::fnv1a(""), 14695981039346656037ull);  // the published FNV-1a offset basis
  EXPECT_EQ(FortuneCorpus::fnv1a("a"), 0xaf63dc4c8601ec8cull);  // and its value for "a"
}

TEST(Fortunes, BlocksAreConsecutiveSlicesOfTheSplitsStream) {
  const int t = 64;
  TokenBlocks blocks(corpus(), TextSplit::validation, t);
  ASSERT_GT(blocks.size(), 100u);
  EXPECT_EQ(blocks.size(), (blocks.tokens() - 1) / t);
  for (std::size_t i = 0; i + 1 < blocks.size(); ++i)
    ASSERT_EQ(blocks.block(i)[t], blocks.block(i + 1)[0]) << "block " << i << "'s last target starts the next";
  const std::string start(reinterpret_cast<const char*>(blocks.block(0)), 16);
  const auto& first = *std::find_if(corpus().entries().begin(), corpus().entries().end(),
                                    [](const TextEntry& e) { return FortuneCorpus::in_validation(e.text); });
  EXPECT_EQ(start, first.text.substr(0, 16));
}

TEST(Fortunes, LabelsCoverTheLargeCategoriesOnly) {
  EntryLabels labels(corpus(), TextSplit::train, 500);
  EXPECT_GE(labels.classes().size(), 10u);
  for (const auto& c : labels.classes()) EXPECT_GE(corpus().count(c), 500u) << c;
  for (std::size_t i = 0; i < labels.size(); ++i) {
    ASSERT_GE(labels.label(i), 0);
    ASSERT_LT(labels.label(i), static_cast<int>(labels.classes().size()));
  }
  EXPECT_THROW(EntryLabels(corpus(), TextSplit::train, 100000), ConfigError);
}

TEST(Fortunes, AMissingCorpusNamesThePackages) {
  try {
    FortuneCorpus missing("/nonexistent/fortunes");
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("apt-get install fortunes"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lockstep::data
