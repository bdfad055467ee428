// lockstep as a package: `cmake --install` into a fresh prefix, then a project outside the
// tree finds it with find_package(lockstep), builds against lockstep::comm and lockstep::ddp,
// and runs under the installed `lockstep run`.
#include <gtest/gtest.h>

#include <filesystem>

#include "testing.h"

namespace fs = std::filesystem;

namespace lockstep::testing {
namespace {

int run(const std::vector<std::string>& argv, double seconds, std::string* output = nullptr) {
  Process p(argv);
  const int code = p.wait(seconds);
  if (output) *output = p.output();
  EXPECT_EQ(code, 0) << p.output();
  return code;
}

TEST(Package, AnOutsideProjectFindsTheInstalledPackageAndRunsUnderLockstepRun) {
  TempDir dir("package");
  const std::string prefix = dir / "prefix", build = dir / "build";
  ASSERT_EQ(run({"/usr/bin/env", "cmake", "--install", LOCKSTEP_BUILD_DIR, "--prefix", prefix}, 120), 0);
  for (const char* f : {"bin/lockstep", "include/lockstep/comm/communicator.h", "include/lockstep/ddp/ddp.h",
                        "lib/cmake/lockstep/lockstepConfig.cmake", "lib/cmake/lockstep/lockstepTargets.cmake"})
    EXPECT_TRUE(fs::exists(fs::path(prefix) / f)) << f;
  // Relocatable: nothing in the package points back into the source or build tree.
  const std::string targets = read_file(prefix + "/lib/cmake/lockstep/lockstepTargets.cmake");
  EXPECT_EQ(targets.find(LOCKSTEP_SOURCE_DIR "/"), std::string::npos);
  EXPECT_EQ(targets.find(LOCKSTEP_BUILD_DIR), std::string::npos);

  ASSERT_EQ(run({"/usr/bin/env", "cmake", "-S", CONSUMER_DIR, "-B", build, "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                 // as any libtorch user does: the libtorch lockstep was built on (Debian's, or a pip
                 // wheel's, whose cmake files and libraries must be found before Debian's)
                 "-DCMAKE_PREFIX_PATH=" + prefix + ";" TORCH_CMAKE_PREFIX, "-DCMAKE_LIBRARY_PATH=" TORCH_LIBRARY_DIR},
                120),
            0);
  ASSERT_EQ(run({"/usr/bin/env", "cmake", "--build", build}, 600), 0);

  std::string out;
  ASSERT_EQ(run({prefix + "/bin/lockstep", "run", "--nproc-per-node", "2", build + "/allreduce"}, 60, &out), 0);
  EXPECT_EQ(count_of(out, "allreduce ok rank"), 2u) << out;
  ASSERT_EQ(run({prefix + "/bin/lockstep", "run", "--nproc-per-node", "2", build + "/ddp_step"}, 120, &out), 0);
  EXPECT_EQ(count_of(out, "ddp ok rank"), 2u) << out;
}

}  // namespace
}  // namespace lockstep::testing
