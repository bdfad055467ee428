// Fuzz target: a run's metrics.jsonl (`lockstep report` and the doctor read it, and so does a
// resumed run's report): any text, one JSON object per line.
#include "fuzz_input.h"
#include "lockstep/train_core/metrics.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = lockstep::fuzz::as_file(data, size, "metrics.jsonl");
  lockstep::fuzz::parses([&] { lockstep::train::metrics::read_metrics(path); });
  return 0;
}
