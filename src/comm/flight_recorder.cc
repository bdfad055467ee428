#include "lockstep/comm/flight_recorder.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "lockstep/base/log.h"
#include "lockstep/error.h"

namespace lockstep::comm {

using nlohmann::json;

namespace {
// "3.0 s": a tenth of a second is as precise as a report of a stall needs.
std::string tenths(double seconds) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", seconds);
  return buf;
}
}  // namespace

double wall_seconds_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

const FlightEntry* FlightRecord::find(std::uint64_t sequence) const {
  for (const auto& e : recent)
    if (e.sequence == sequence) return &e;
  return nullptr;
}

std::string FlightRecord::doing(double now) const {
  const double age = std::max(0.0, now - published_at);
  if (!error.empty() && !recent.empty() && recent.back().finished_ago >= 0) {
    const FlightEntry& last = recent.back();
    return "failed in " + last.what + " after " + tenths(last.started_ago - last.finished_ago) + ": " +
           error;
  }
  for (auto it = recent.rbegin(); it != recent.rend(); ++it)
    if (it->in_flight()) return "in " + it->what + " for " + tenths(it->started_ago + age);
  for (auto it = recent.rbegin(); it != recent.rend(); ++it)
    if (it->finished_ago >= 0)
      return "idle for " + tenths(it->finished_ago + age) + " since " + it->what + " finished";
  return "no collective issued yet";
}

std::string FlightRecord::to_json() const {
  json entries = json::array();
  for (const auto& e : recent)
    entries.push_back({e.sequence, e.what, e.signature, e.issued_ago, e.started_ago, e.finished_ago});
  return json{{"rank", rank}, {"backend", backend}, {"at", published_at}, {"error", error}, {"recent", entries}}
      .dump();
}

FlightRecord FlightRecord::from_json(const std::string& text) {
  try {
    const json j = json::parse(text);
    FlightRecord r;
    r.rank = j.at("rank").get<int>();
    r.backend = j.at("backend").get<std::string>();
    r.published_at = j.at("at").get<double>();
    r.error = j.at("error").get<std::string>();
    for (const auto& e : j.at("recent"))
      r.recent.push_back(FlightEntry{e.at(0).get<std::uint64_t>(), e.at(1).get<std::string>(),
                                     e.at(2).get<std::uint64_t>(), e.at(3).get<double>(), e.at(4).get<double>(),
                                     e.at(5).get<double>()});
    return r;
  } catch (const json::exception& e) {
    throw Error(std::string("flight record is not valid: ") + e.what());
  }
}

std::string flight_key(const std::string& communicator, int rank) {
  return "flight/" + communicator + "/" + std::to_string(rank);
}

std::vector<std::optional<FlightRecord>> read_flight_records(StoreClient& store, const std::string& communicator,
                                                             int size) {
  std::vector<std::optional<FlightRecord>> out;
  for (int r = 0; r < size; ++r) {
    auto text = store.try_get(flight_key(communicator, r));
    out.push_back(text ? std::optional<FlightRecord>(FlightRecord::from_json(*text)) : std::nullopt);
  }
  return out;
}

namespace {
// How far a rank got: one past the highest sequence it issued (0: none, or no record).
std::uint64_t progress(const std::optional<FlightRecord>& r) {
  return r && !r->recent.empty() ? r->recent.back().sequence + 1 : 0;
}
}  // namespace

std::vector<std::string> describe_flight(const std::vector<std::optional<FlightRecord>>& records) {
  std::vector<std::size_t> order(records.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return progress(records[a]) < progress(records[b]); });
  const double now = wall_seconds_now();
  std::vector<std::string> lines;
  for (std::size_t r : order) {
    const auto& rec = records[r];
    lines.push_back("rank " + std::to_string(r) + ": " +
                    (rec ? rec->doing(now) : "published nothing (it died first, or stalled for less than LOCKSTEP_PEER_CHECK)"));
  }
  return lines;
}

}  // namespace lockstep::comm
