#include <gtest/gtest.h>
#include <zlib.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <numeric>

#include "lockstep/data/evaluation.h"
#include "lockstep/data/fashion_mnist.h"
#include "lockstep/data/idx.h"
#include "lockstep/data/loader.h"
#include "lockstep/data/sampler.h"
#include "testing.h"

namespace lockstep::data {
namespace {

std::string gunzip(const std::string& path) {
  gzFile f = gzopen(path.c_str(), "rb");
  std::string out;
  char buf[1 << 16];
  int n;
  while ((n = gzread(f, buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  gzclose(f);
  return out;
}

void write(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string error_of(const std::string& path) {
  try {
    read_idx(path);
  } catch (const DataError& e) {
    return e.what();
  }
  return "";
}

TEST(FashionMnist, TheRealDatasetLoads) {
  FashionMnist train(FashionMnist::Split::train), test(FashionMnist::Split::test);
  EXPECT_EQ(train.size(), 60000u);
  EXPECT_EQ(test.size(), 10000u);
  std::vector<int> per_class(10, 0);
  for (std::size_t i = 0; i < train.size(); ++i) ++per_class[static_cast<std::size_t>(train.label(i))];
  for (int c = 0; c < 10; ++c)
    EXPECT_EQ(per_class[static_cast<std::size_t>(c)], 6000) << FashionMnist::class_name(c);
  // An image is not blank: clothing occupies a good part of the 28x28 frame.
  int lit = 0;
  for (int p = 0; p < FashionMnist::kPixels; ++p) lit += train.image(0)[p] > 0;
  EXPECT_GT(lit, 100);
}

TEST(FashionMnist, AMissingDatasetNamesThePackage) {
  try {
    FashionMnist m(FashionMnist::Split::train, "/nonexistent/fashion");
    FAIL();
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("dataset-fashion-mnist"), std::string::npos) << e.what();
  }
}

TEST(Idx, CorruptAndTruncatedFilesAreClearErrors) {
  testing::TempDir temp("idx");
  const std::string dir = temp.path();
  std::string labels = gunzip(std::string(kFashionMnistDir) + "/t10k-labels-idx1-ubyte.gz");
  ASSERT_EQ(labels.size(), 8u + 10000u);

  write(dir + "/raw", labels);  // raw (not gzip) is fine
  EXPECT_EQ(read_idx(dir + "/raw").dims, std::vector<std::uint32_t>{10000});

  write(dir + "/truncated", labels.substr(0, 5000));
  EXPECT_NE(error_of(dir + "/truncated").find("truncated: the header says 10000"), std::string::npos);

  write(dir + "/long", labels + "xx");
  EXPECT_NE(error_of(dir + "/long").find("bytes after"), std::string::npos);

  std::string bad_magic = labels;
  bad_magic[0] = 0x1f;
  write(dir + "/magic", bad_magic);
  EXPECT_NE(error_of(dir + "/magic").find("not an IDX file"), std::string::npos);

  std::string bad_type = labels;
  bad_type[2] = 0x42;
  write(dir + "/type", bad_type);
  EXPECT_NE(error_of(dir + "/type").find("unknown IDX element type 0x42"), std::string::npos);

  write(dir + "/header", labels.substr(0, 6));
  EXPECT_NE(error_of(dir + "/header").find("truncated IDX header"), std::string::npos);

  // A gzip file cut in the middle: zlib notices, and so do we.
  std::ifstream gz(std::string(kFashionMnistDir) + "/t10k-images-idx3-ubyte.gz", std::ios::binary);
  std::string compressed((std::istreambuf_iterator<char>(gz)), {});
  write(dir + "/cut.gz", compressed.substr(0, compressed.size() / 2));
  std::string err = error_of(dir + "/cut.gz");
  EXPECT_TRUE(err.find("truncated") != std::string::npos || err.find("gzip") != std::string::npos) << err;
  EXPECT_NE(err.find(dir + "/cut.gz"), std::string::npos) << "the error must name the file: " << err;

  EXPECT_NE(error_of(dir + "/absent").find("cannot open"), std::string::npos);
}

// A header's shape is not trusted: one whose element count wraps 64 bits to 0 is no empty array,
// and one that claims 2 GiB over two bytes of data is refused without allocating the 2 GiB (both
// found by tests/fuzz/idx_fuzz.cc).
TEST(Idx, AShapeThatWrapsOrOverclaimsIsAClearError) {
  testing::TempDir temp("idx-shape");
  const std::string dir = temp.path();
  auto header = [](std::vector<std::uint32_t> dims) {
    std::string h{'\0', '\0', '\x08', static_cast<char>(dims.size())};
    for (auto d : dims)
      for (int shift = 24; shift >= 0; shift -= 8) h.push_back(static_cast<char>(d >> shift));
    return h;
  };
  write(dir + "/wraps", header({65536, 65536, 65536, 65536}));
  EXPECT_NE(error_of(dir + "/wraps").find("implausible shape 65536x65536x65536x65536"), std::string::npos);
  write(dir + "/claims", header({0x80000000u}) + "ab");
  EXPECT_NE(error_of(dir + "/claims").find("but the file holds 2"), std::string::npos);
}

std::vector<std::vector<std::size_t>> all_batches(const FashionMnist& data,
                                                  const std::vector<std::size_t>& idx, int workers,
                                                  std::vector<float>* first_images = nullptr) {
  DataLoader<ImageBatch> loader(
      idx, [&](const std::vector<std::size_t>& i) { return data.batch(i); },
      LoaderOptions{64, false, workers, 0});
  std::vector<std::vector<std::size_t>> out;
  while (auto b = loader.next()) {
    if (first_images && out.empty()) *first_images = b->images;
    for (std::size_t k = 0; k < b->size(); ++k) EXPECT_EQ(b->labels[k], data.label(b->indices[k]));
    out.push_back(b->indices);
  }
  return out;
}

TEST(Loader, ZeroOneAndFourWorkersGiveIdenticalBatches) {
  FashionMnist test(FashionMnist::Split::test);
  DistributedSampler sampler(test.size(), 1, 3, true, 5);
  sampler.set_epoch(2);
  std::vector<float> img0, img1, img4;
  auto b0 = all_batches(test, sampler.indices(), 0, &img0);
  auto b1 = all_batches(test, sampler.indices(), 1, &img1);
  auto b4 = all_batches(test, sampler.indices(), 4, &img4);
  EXPECT_EQ(b0.size(), (sampler.num_samples() + 63) / 64);
  EXPECT_EQ(b0, b1);
  EXPECT_EQ(b0, b4);
  EXPECT_EQ(img0, img4);
}

TEST(Loader, AnExceptionInAWorkerSurfacesInTheCaller) {
  std::vector<std::size_t> idx(100);
  std::iota(idx.begin(), idx.end(), std::size_t{0});
  DataLoader<int> loader(
      idx,
      [](const std::vector<std::size_t>& i) {
        if (i.front() == 40) throw std::runtime_error("sample 40 is unreadable");
        return static_cast<int>(i.front());
      },
      LoaderOptions{10, false, 3, 0});
  for (int b = 0; b < 4; ++b) EXPECT_EQ(*loader.next(), b * 10);
  try {
    loader.next();
    FAIL() << "the error was swallowed";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "sample 40 is unreadable");
  }
}

TEST(Loader, StopsCleanlyMidEpochAndStaysWithinItsPrefetchBound) {
  std::atomic<int> built{0};
  std::vector<std::size_t> idx(1000);
  std::iota(idx.begin(), idx.end(), std::size_t{0});
  {
    DataLoader<int> loader(
        idx,
        [&](const std::vector<std::size_t>& i) {
          ++built;
          return static_cast<int>(i[0]);
        },
        LoaderOptions{1, false, 4, 8});
    for (int b = 0; b < 3; ++b) EXPECT_EQ(*loader.next(), b);
  }  // destroyed with ~990 batches unbuilt: must join promptly
  EXPECT_LE(built.load(), 3 + 8);
}

TEST(Loader, DropLastDropsTheShortBatch) {
  std::vector<std::size_t> idx(10);
  DataLoader<std::size_t> keep(
      idx, [](const auto& i) { return i.size(); }, LoaderOptions{4, false, 0, 0});
  DataLoader<std::size_t> drop(
      idx, [](const auto& i) { return i.size(); }, LoaderOptions{4, true, 2, 0});
  EXPECT_EQ(keep.num_batches(), 3u);
  EXPECT_EQ(drop.num_batches(), 2u);
}

// N = 10 not divisible by R = 3: each rank gets 4 indices (2 of the 12 are padding). Counting
// only real samples, the allreduced totals hold each of the 10 samples exactly once.
TEST(Evaluation, EveryRealSampleCountsOnceAcrossRanks) {
  for (int world : {1, 2, 3, 4}) {
    std::vector<EvalTotals> results(static_cast<std::size_t>(world));
    testing::run_ranks_as_threads(world, comm::CommOptions{"shm"}, [&](comm::Communicator& c) {
      DistributedSampler s(10, c.rank(), c.size(), true, 1);
      EvalTotals local;
      for (std::size_t k = 0; k < s.num_samples(); ++k) {
        if (s.is_padding(k)) continue;
        std::size_t i = s.indices()[k];
        local.loss_sum += static_cast<double>(i);  // sum of 0..9 = 45
        local.correct += i % 2 == 0;               // 5 even indices
        local.count += 1;
      }
      results[static_cast<std::size_t>(c.rank())] = allreduce_totals(c, local);
    });
    for (const auto& t : results) {
      EXPECT_EQ(t.count, 10) << "world " << world;
      EXPECT_EQ(t.correct, 5) << "world " << world;
      EXPECT_EQ(t.loss_sum, 45.0) << "world " << world;
    }
  }
}

}  // namespace
}  // namespace lockstep::data
