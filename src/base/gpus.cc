#include "lockstep/base/gpus.h"

#include <algorithm>
#include <filesystem>
#include <set>
#include <sstream>

#include "lockstep/base/knobs.h"

namespace lockstep {
namespace {

bool is_index(const std::string& entry) {
  return !entry.empty() && std::all_of(entry.begin(), entry.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool is_uuid(const std::string& entry) { return entry.rfind("GPU-", 0) == 0 || entry.rfind("MIG-", 0) == 0; }

std::string trimmed(const std::string& s) {
  const auto begin = s.find_first_not_of(" \t");
  if (begin == std::string::npos) return "";
  return s.substr(begin, s.find_last_not_of(" \t") - begin + 1);
}

}  // namespace

int visible_gpus(int driver_gpus, const std::optional<std::string>& visible) {
  if (!visible) return driver_gpus;
  std::set<std::string> named;
  std::istringstream entries(*visible);
  for (std::string entry; std::getline(entries, entry, ',');) {
    entry = trimmed(entry);
    if (is_index(entry) && entry.size() < 6 && std::stoi(entry) < driver_gpus) {
      named.insert(std::to_string(std::stoi(entry)));
    } else if (is_uuid(entry)) {
      named.insert(entry);
    } else {
      break;
    }
  }
  return std::min(static_cast<int>(named.size()), driver_gpus);
}

int visible_gpus(const std::string& driver_dir) {
  std::error_code ec;
  int listed = 0;
  for (const auto& entry : std::filesystem::directory_iterator(driver_dir, ec))
    if (entry.is_directory()) ++listed;
  // Set but empty hides every GPU, as in CUDA (get() would read it as unset).
  if (knobs::is_set(knobs::kCudaVisibleDevices))
    return visible_gpus(listed, knobs::get(knobs::kCudaVisibleDevices).value_or(""));
  return visible_gpus(listed, std::nullopt);
}

int auto_nproc_per_node(int gpus, unsigned cores) {
  return gpus > 0 ? gpus : static_cast<int>(std::max(1u, cores));
}

}  // namespace lockstep
