#include "metrics_file.h"

#include <fstream>

namespace lockstep::testing {

std::vector<nlohmann::json> metrics_events(const std::string& path, const std::string& event) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    if (j.value("event", "") == event) out.push_back(std::move(j));
  }
  return out;
}

}  // namespace lockstep::testing
