// What a run wrote to its metrics.jsonl (docs/metrics.md): the lines of one event, in order.
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

namespace lockstep::testing {

// Every line of `path` whose "event" is `event` ("log", "checkpoint", ...), parsed.
std::vector<nlohmann::json> metrics_events(const std::string& path, const std::string& event);

}  // namespace lockstep::testing
