// Replays corpus files through a fuzz target once, without libFuzzer: the build with g++ (and
// ctest) runs every corpus input as a regression test. Arguments: files or directories.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size);

namespace {
void replay(const std::filesystem::path& file) {
  std::ifstream in(file, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
}
}  // namespace

int main(int argc, char** argv) {
  std::size_t n = 0;
  for (int i = 1; i < argc; ++i) {
    const std::filesystem::path arg(argv[i]);
    if (std::filesystem::is_directory(arg)) {
      for (const auto& entry : std::filesystem::directory_iterator(arg))
        if (entry.is_regular_file()) replay(entry.path()), ++n;
    } else {
      replay(arg), ++n;
    }
  }
  if (n == 0) {
    std::cerr << "no corpus inputs found in the arguments\n";
    return 1;
  }
  std::cout << "replayed " << n << " inputs\n";
  return 0;
}
