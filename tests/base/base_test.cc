// The base layer: log lines and their filters, the environment-variable table against the
// docs and the sources, exit codes and the main() wrapper.
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "lockstep/base/cpu_kernels.h"
#include "lockstep/base/gpus.h"
#include "lockstep/base/knobs.h"
#include "lockstep/base/log.h"
#include "lockstep/base/main.h"
#include "lockstep/error.h"
#include "testing.h"

namespace fs = std::filesystem;
using namespace lockstep;

namespace {

// What `fn` writes to stderr (the log's and run_main's destination), read back from a file.
std::string stderr_of(const std::function<void()>& fn) {
  lockstep::testing::TempDir dir("stderr");
  const std::string path = dir / "err";
  fflush(stderr);
  const int saved = ::dup(STDERR_FILENO);
  const int file = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ::dup2(file, STDERR_FILENO);
  ::close(file);
  fn();
  fflush(stderr);
  ::dup2(saved, STDERR_FILENO);
  ::close(saved);
  return lockstep::testing::read_file(path);
}

std::string between(const std::string& text, const std::string& begin, const std::string& end) {
  auto a = text.find(begin);
  auto b = text.find(end);
  if (a == std::string::npos || b == std::string::npos || b < a)
    return "(markers " + begin + " / " + end + " missing)";
  a += begin.size();
  while (a < text.size() && text[a] == '\n') ++a;
  return text.substr(a, b - a);
}

}  // namespace

TEST(Log, ALineNamesTheRankTheSubsystemAndALevelAboveInfo) {
  using log::Level;
  using log::Subsystem;
  EXPECT_EQ(log::format_line(Level::info, Subsystem::run, -1, "job FAILED"), "lockstep run: job FAILED\n");
  EXPECT_EQ(log::format_line(Level::warn, Subsystem::comm, 3, "slow"),
            "lockstep[rank 3] comm: warning: slow\n");
  EXPECT_EQ(log::format_line(Level::error, Subsystem::base, 0, "x"), "lockstep[rank 0]: error: x\n");
  EXPECT_EQ(log::format_line(Level::debug, Subsystem::store, -1, "y"), "lockstep store: debug: y\n");
}

TEST(Log, LevelAndSubsystemFiltersParseAsDocumented) {
  using log::Subsystem;
  EXPECT_EQ(log::parse_level("error"), log::Level::error);
  EXPECT_EQ(log::parse_level("warn"), log::Level::warn);
  EXPECT_EQ(log::parse_level("debug"), log::Level::debug);
  EXPECT_EQ(log::parse_level("info"), log::Level::info);
  const unsigned some = log::parse_subsystems("comm,store");
  EXPECT_EQ(some, static_cast<unsigned>(Subsystem::comm) | static_cast<unsigned>(Subsystem::store));
  const unsigned but = log::parse_subsystems("^train");
  EXPECT_EQ(but & static_cast<unsigned>(Subsystem::train), 0u);
  EXPECT_NE(but & static_cast<unsigned>(Subsystem::run), 0u);
  EXPECT_NE(log::parse_subsystems("all") & static_cast<unsigned>(Subsystem::doctor), 0u);
}

TEST(Log, OneWritePerLineReachesStderr) {
  const std::string out = stderr_of([] { LOCKSTEP_LOG(error, train) << "disk " << 42 << " full"; });
  EXPECT_NE(out.find("train: error: disk 42 full\n"), std::string::npos) << out;
}

// docs/environment.md holds the table generated from knobs.h, between its markers.
TEST(Knobs, TheDocsListExactlyTheTable) {
  const std::string doc = lockstep::testing::read_file(LOCKSTEP_SOURCE_DIR "/docs/environment.md");
  const std::string table = between(doc, "<!-- knobs:begin -->", "<!-- knobs:end -->");
  EXPECT_EQ(table, knobs::markdown())
      << "docs/environment.md is out of date: replace the text between its markers with the output of "
         "`build/tools/lockstep env --markdown`";
}

// Every variable is read through the table: no source file but knobs.cc calls getenv or walks
// environ itself.
TEST(Knobs, NoSourceReadsTheEnvironmentBehindTheTablesBack) {
  const std::regex direct(R"(\bgetenv\s*\(|\benviron\b|secure_getenv)");
  std::vector<std::string> offenders;
  for (const char* dir : {"src", "tools", "examples", "bench", "include"}) {
    for (const auto& entry : fs::recursive_directory_iterator(fs::path(LOCKSTEP_SOURCE_DIR) / dir)) {
      const std::string ext = entry.path().extension().string();
      if (ext != ".cc" && ext != ".h" && ext != ".cpp") continue;
      if (entry.path().filename() == "knobs.cc") continue;
      std::ifstream in(entry.path());
      int line_no = 0;
      for (std::string line; std::getline(in, line);) {
        ++line_no;
        const auto comment = line.find("//");
        const std::string code = comment == std::string::npos ? line : line.substr(0, comment);
        if (std::regex_search(code, direct))
          offenders.push_back(fs::relative(entry.path(), LOCKSTEP_SOURCE_DIR).string() + ":" +
                              std::to_string(line_no) + ": " + line);
      }
    }
  }
  for (const auto& o : offenders)
    ADD_FAILURE() << "reads the environment directly (use lockstep/base/knobs.h): " << o;
}

// Help texts and docs that list the backends list them all (comm::kBackendNames is the one list):
// a line naming three or more backends in a row ("shm | gloo | mpi", "shm, gloo or mpi") must name
// every one of shm, gloo, hier, mpi and nccl.
TEST(Backends, EveryListOfBackendsInTheDocsAndHelpTextsIsWhole) {
  const std::regex listing(R"((shm|gloo|hier|mpi|nccl|auto)(\s*(\||,|,? or)\s*(shm|gloo|hier|mpi|nccl|auto)){2,})");
  std::vector<std::string> offenders;
  for (const char* dir : {"src", "tools", "examples", "include", "docs", "python", "README.md"}) {
    const fs::path root = fs::path(LOCKSTEP_SOURCE_DIR) / dir;
    std::vector<fs::path> files;
    if (fs::is_regular_file(root)) files.push_back(root);
    if (fs::is_directory(root))
      for (const auto& entry : fs::recursive_directory_iterator(root))
        if (entry.is_regular_file()) files.push_back(entry.path());
    for (const auto& file : files) {
      const std::string ext = file.extension().string();
      if (ext != ".cc" && ext != ".h" && ext != ".md" && ext != ".py") continue;
      std::ifstream in(file);
      int line_no = 0;
      for (std::string line; std::getline(in, line);) {
        ++line_no;
        std::smatch m;
        if (!std::regex_search(line, m, listing)) continue;
        const std::string list = m.str();
        for (const char* b : {"shm", "gloo", "hier", "mpi", "nccl"})
          if (!std::regex_search(list, std::regex(std::string("\\b") + b + "\\b")))
            offenders.push_back(fs::relative(file, LOCKSTEP_SOURCE_DIR).string() + ":" + std::to_string(line_no) +
                                " lists backends without " + b + ": " + list);
      }
    }
  }
  for (const auto& o : offenders) ADD_FAILURE() << o;
}

TEST(Knobs, GetFallsBackToTheDefaultAndLookupDoesNot) {
  ::unsetenv(knobs::kRunId.name);
  EXPECT_EQ(knobs::get(knobs::kRunId), "default");
  EXPECT_FALSE(knobs::is_set(knobs::kRunId));
  ::setenv(knobs::kRunId.name, "mine", 1);
  EXPECT_EQ(knobs::get(knobs::kRunId), "mine");
  ::unsetenv(knobs::kRunId.name);
  EXPECT_EQ(knobs::lookup({{"LOCKSTEP_RUN_ID", ""}}, knobs::kRunId), std::nullopt);
  EXPECT_EQ(knobs::lookup({{"LOCKSTEP_RUN_ID", "x"}}, knobs::kRunId), "x");
}

TEST(ExitCodes, EachErrorHasItsDocumentedCode) {
  EXPECT_EQ(exit_code_for(ConfigError("x")), kExitBadInput);
  EXPECT_EQ(exit_code_for(DataError("x")), kExitBadInput);
  EXPECT_EQ(exit_code_for(AuthError("x")), kExitBadInput);
  EXPECT_EQ(exit_code_for(StorageError("x")), kExitNoStorage);
  EXPECT_EQ(exit_code_for(PeerError("x")), kExitFailure);
  EXPECT_EQ(exit_code_for(TimeoutError("x")), kExitFailure);
  EXPECT_EQ(exit_code_for(std::runtime_error("x")), kExitFailure);
  EXPECT_FALSE(restart_can_help(kExitBadInput));
  EXPECT_FALSE(restart_can_help(kExitNoStorage));
  EXPECT_TRUE(restart_can_help(kExitFailure));
  EXPECT_TRUE(restart_can_help(kExitSignalBase + 9));
}

TEST(ExitCodes, RunMainTurnsAnExceptionIntoOneLineAndItsCode) {
  char name[] = "/some/where/prog";
  char* argv[] = {name, nullptr};
  int code = 0;
  const std::string out = stderr_of([&] {
    code = run_main(1, argv, []() -> int { throw StorageError("no space left on the device holding /x"); });
  });
  EXPECT_EQ(code, kExitNoStorage);
  EXPECT_EQ(out, "prog: error: no space left on the device holding /x\n");
  // libtorch's errors carry a stack trace after their first line: only the first line is shown.
  const std::string multi = stderr_of([&] {
    code =
        run_main(1, argv, []() -> int { throw std::runtime_error("bad thing\nframe #0 ...\nframe #1 ..."); });
  });
  EXPECT_EQ(code, kExitFailure);
  EXPECT_EQ(multi, "prog: error: bad thing\n");
}

TEST(ExitCodes, AFullDiskIsAStorageErrorNamingThePath) {
  try {
    throw_write_error("/out/checkpoint-4/model.pt", ENOSPC, "checkpoint-2 is intact");
  } catch (const StorageError& e) {
    EXPECT_NE(std::string(e.what()).find("/out/checkpoint-4/model.pt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("checkpoint-2 is intact"), std::string::npos) << e.what();
  }
  EXPECT_THROW(throw_write_error("/x", EACCES), SystemError);
}

// ----- the CPU's kernels ---------------------------------------------------------------------

TEST(CpuKernels, TheCpusBestKernelsComeFromItsFlags) {
  EXPECT_EQ(best_openblas_core("fpu sse2 avx avx2 fma avx512f avx512dq avx512bw avx512vl"), "SkylakeX");
  EXPECT_EQ(best_openblas_core("fpu sse2 avx avx2 fma avx512f"), "Haswell");  // partial AVX-512
  EXPECT_EQ(best_openblas_core("fpu sse2 avx avx2 fma"), "Haswell");
  EXPECT_EQ(best_openblas_core("fpu sse2 avx"), "Sandybridge");
  EXPECT_EQ(best_openblas_core("fpu sse2 sse3"), "");
}

TEST(CpuKernels, OnlyAKnownSlowerPickIsBelowTheBest) {
  EXPECT_TRUE(openblas_core_below("Prescott", "SkylakeX"));  // Debian 12's OpenBLAS on Emerald Rapids
  EXPECT_TRUE(openblas_core_below("Sandybridge", "Haswell"));
  EXPECT_FALSE(openblas_core_below("SkylakeX", "SkylakeX"));
  EXPECT_FALSE(openblas_core_below("Cooperlake", "SkylakeX"));  // as wide
  EXPECT_FALSE(openblas_core_below("Zen", "Haswell"));
  EXPECT_FALSE(openblas_core_below("SkylakeX", "Haswell"));  // faster than the flags say: leave it
  EXPECT_FALSE(openblas_core_below("", "SkylakeX"));         // not OpenBLAS
  EXPECT_FALSE(openblas_core_below("SomeFutureCore", "SkylakeX"));
  EXPECT_FALSE(openblas_core_below("Prescott", ""));
}

// The child's answer is what OpenBLAS picks when loaded here with no OPENBLAS_CORETYPE.
TEST(CpuKernels, OpenblasOwnPickIsAskedOfAChildWithoutTheOverride) {
  ::setenv("OPENBLAS_CORETYPE", "Prescott", 1);  // the child must not see it
  const std::string own = openblas_own_core();
  ::unsetenv("OPENBLAS_CORETYPE");
  void* blas = ::dlopen("libblas.so.3", RTLD_NOW | RTLD_LOCAL);
  auto corename = blas ? reinterpret_cast<char* (*)()>(::dlsym(blas, "openblas_get_corename")) : nullptr;
  if (!corename) {
    EXPECT_EQ(own, "");
    GTEST_SKIP() << "libblas.so.3 is not OpenBLAS here";
  }
  EXPECT_EQ(own, corename());
}

// The driver's GPU list is a directory per GPU; a test builds one of its own, so the count holds on
// any host, with a GPU or without.
TEST(Gpus, TheDriversDirectoriesAreTheGpusAndCudaVisibleDevicesNarrowsThem) {
  lockstep::testing::TempDir dir("gpus");
  const std::string gpus = dir / "gpus";
  const char* saved = std::getenv(knobs::kCudaVisibleDevices.name);
  const std::optional<std::string> restore = saved ? std::optional<std::string>(saved) : std::nullopt;
  ::unsetenv(knobs::kCudaVisibleDevices.name);
  EXPECT_EQ(visible_gpus(gpus), 0);  // no driver loaded: no such directory
  fs::create_directories(gpus);
  for (const char* bus : {"0000:18:00.0", "0000:2a:00.0", "0000:3b:00.0"}) fs::create_directory(fs::path(gpus) / bus);
  std::ofstream(fs::path(gpus) / "README") << "not a GPU";
  EXPECT_EQ(visible_gpus(gpus), 3);
  ::setenv(knobs::kCudaVisibleDevices.name, "2,0", 1);
  EXPECT_EQ(visible_gpus(gpus), 2);
  ::setenv(knobs::kCudaVisibleDevices.name, "", 1);  // set and empty: none, as in CUDA
  EXPECT_EQ(visible_gpus(gpus), 0);
  if (restore)
    ::setenv(knobs::kCudaVisibleDevices.name, restore->c_str(), 1);
  else
    ::unsetenv(knobs::kCudaVisibleDevices.name);
}

TEST(Gpus, CudaVisibleDevicesIsReadAsCudaReadsIt) {
  EXPECT_EQ(visible_gpus(4, std::nullopt), 4);
  EXPECT_EQ(visible_gpus(4, "1,3"), 2);
  EXPECT_EQ(visible_gpus(4, " 1 , 3 "), 2);
  EXPECT_EQ(visible_gpus(4, "1,1"), 1);       // named twice, one GPU
  EXPECT_EQ(visible_gpus(4, "1,7,2"), 1);     // the list ends at the first index the driver lacks
  EXPECT_EQ(visible_gpus(4, "-1"), 0);        // the usual way to hide them all
  EXPECT_EQ(visible_gpus(4, "0,x,1"), 1);     // and at the first entry that is no index or UUID
  EXPECT_EQ(visible_gpus(2, "GPU-8f3c2e1a-0000-0000-0000-000000000000,1"), 2);
  EXPECT_EQ(visible_gpus(0, "0,1"), 0);       // no driver, nothing to see whatever is named
  EXPECT_EQ(visible_gpus(1, "MIG-1,MIG-2"), 1);  // never more than the driver drives
}

TEST(Gpus, AutoStartsOneWorkerPerGpuElseOnePerCore) {
  EXPECT_EQ(auto_nproc_per_node(2, 16), 2);
  EXPECT_EQ(auto_nproc_per_node(0, 16), 16);
  EXPECT_EQ(auto_nproc_per_node(0, 0), 1);  // hardware_concurrency() may not know
}
