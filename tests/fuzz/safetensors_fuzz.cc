// Fuzz target: a safetensors file's bytes (Hugging Face weights a user downloads).
// Beyond "errors are lockstep::Errors": every tensor the reader accepts has exactly the bytes
// its dtype and shape say, inside the file (AddressSanitizer checks each byte is read).
#include <cstdlib>
#include <string>

#include "fuzz_input.h"
#include "lockstep/train_core/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  lockstep::fuzz::parses([&] {
    const lockstep::train::SafetensorsFile file(std::string(reinterpret_cast<const char*>(data), size), "fuzz");
    unsigned sum = 0;
    for (const auto& [name, t] : file.tensors()) {
      const std::size_t want = static_cast<std::size_t>(t.numel()) * lockstep::train::safetensors_element_size(t.dtype);
      if (t.bytes.size() != want) std::abort();
      for (const char c : t.bytes) sum += static_cast<unsigned char>(c);
    }
    if (sum == 0xFFFFFFFFu) std::abort();  // keeps the reads
  });
  return 0;
}
