// Fuzz target: a run's metrics.jsonl (`lockstep report`, the doctor and `lockstep plan` read it,
// and so does a resumed run's report): any text, one JSON object per line.
#include <filesystem>

#include "fuzz_input.h"
#include "lockstep/doctor/plan.h"
#include "lockstep/train_core/metrics.h"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string path = lockstep::fuzz::as_file(data, size, "metrics.jsonl");
  lockstep::fuzz::parses([&] { lockstep::train::metrics::read_metrics(path); });
  lockstep::fuzz::parses([&] { lockstep::doctor::step_of_run(std::filesystem::path(path).parent_path().string()); });
  return 0;
}
