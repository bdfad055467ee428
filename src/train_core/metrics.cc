#include "lockstep/train_core/metrics.h"

#include <fstream>
#include <type_traits>

#include "lockstep/error.h"
#include "lockstep/train_core/json_integer.h"

namespace lockstep::train::metrics {
namespace {

using nlohmann::json;

template <class T>
void put(json& j, const char* key, const T& value) {
  j[key] = value;
}
template <class T>
void put(json& j, const char* key, const std::optional<T>& value) {
  if (value) j[key] = *value;
}

// The value of `key` as T; an integer field refuses what it cannot hold (json_integer.h).
template <class T>
T value_as(const json& v, const char* key) {
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>)
    return json_integer<T>(v, std::string("'") + key + "'");
  else
    return v.get<T>();
}

template <class T>
void take(const json& j, const char* key, T& value) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return;
  value = value_as<T>(*it, key);
}
template <class T>
void take(const json& j, const char* key, std::optional<T>& value) {
  auto it = j.find(key);
  if (it != j.end() && !it->is_null()) value = value_as<T>(*it, key);
}

template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};

template <class T>
struct is_vector : std::false_type {};
template <class T>
struct is_vector<std::vector<T>> : std::true_type {};

template <class T>
std::string type_name() {
  if constexpr (is_optional<T>::value)
    return type_name<typename T::value_type>() + ", optional";
  else if constexpr (is_vector<T>::value)
    return "array of " + type_name<typename T::value_type>();
  else if constexpr (std::is_same_v<T, std::string>)
    return "string";
  else if constexpr (std::is_same_v<T, bool>)
    return "boolean";
  else if constexpr (std::is_integral_v<T>)
    return "integer";
  else
    return "number";
}

#define LOCKSTEP_PUT(type, name, meaning) put(j, #name, name);
#define LOCKSTEP_TAKE(type, name, meaning) take(j, #name, r.name);
#define LOCKSTEP_DOC_ROW(type, name, meaning) \
  out += "| `" #name "` | " + std::string(type_name<type>()) + " | " + (meaning) + " |\n";

// Lines written before records carried an "event" key are told apart by their keys.
std::string event_of(const json& j) {
  if (auto e = j.find("event"); e != j.end() && e->is_string()) return e->get<std::string>();
  if (j.contains("eval_loss")) return kEval;
  if (j.contains("loss")) return kLog;
  return "";
}

}  // namespace

// A record type's writer and reader, both from its one list of fields (metrics.h).
#define LOCKSTEP_RECORD_JSON(Type, event, FIELDS) \
  json Type::to_json() const {                   \
    json j = {{"event", event}};                 \
    FIELDS(LOCKSTEP_PUT)                         \
    return j;                                    \
  }                                              \
  Type Type::from_json(const json& j) {          \
    Type r;                                      \
    FIELDS(LOCKSTEP_TAKE)                        \
    return r;                                    \
  }

LOCKSTEP_RECORD_JSON(TrainBegin, kTrainBegin, LOCKSTEP_TRAIN_BEGIN_FIELDS)
LOCKSTEP_RECORD_JSON(StepLog, kLog, LOCKSTEP_STEP_LOG_FIELDS)
LOCKSTEP_RECORD_JSON(EvalLog, kEval, LOCKSTEP_EVAL_LOG_FIELDS)
LOCKSTEP_RECORD_JSON(MembershipChangeLog, kMembershipChange, LOCKSTEP_MEMBERSHIP_CHANGE_FIELDS)
LOCKSTEP_RECORD_JSON(CheckpointLog, kCheckpoint, LOCKSTEP_CHECKPOINT_FIELDS)

std::vector<Segment> read_metrics(const std::string& path) {
  std::ifstream in(path);
  if (!in)
    throw ConfigError("cannot read " + path + ": it is written by a lockstep Trainer run (--output-dir)");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  std::vector<Segment> segments;
  for (std::size_t i = 0; i < lines.size(); ++i) {
    if (lines[i].empty()) continue;
    json j = json::parse(lines[i], nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object()) {
      if (i + 1 == lines.size()) break;  // cut short by a kill: the rest of the file is fine
      throw ConfigError(path + ":" + std::to_string(i + 1) +
                        " is not a JSON object: " + lines[i].substr(0, 80));
    }
    const std::string event = event_of(j);
    try {
      if (event == kTrainBegin) {
        segments.emplace_back();
        segments.back().begin = TrainBegin::from_json(j);
        continue;
      }
      if (segments.empty()) segments.emplace_back();  // lines before any train_begin
      if (event == kLog) segments.back().logs.push_back(StepLog::from_json(j));
      if (event == kEval) segments.back().evals.push_back(EvalLog::from_json(j));
      if (event == kMembershipChange)
        segments.back().membership_changes.push_back(MembershipChangeLog::from_json(j));
      if (event == kCheckpoint) segments.back().checkpoints.push_back(CheckpointLog::from_json(j));
    } catch (const json::exception& e) {
      throw ConfigError(path + ":" + std::to_string(i + 1) + ": a value has the wrong type (" + e.what() +
                        ")");
    } catch (const DataError& e) {
      throw ConfigError(path + ":" + std::to_string(i + 1) + ": " + e.what());
    }
  }
  return segments;
}

std::string markdown() {
  std::string out;
  const char* head = "| key | type | meaning |\n|---|---|---|\n";
  out += "### `train_begin`\n\n" + std::string(head);
  LOCKSTEP_TRAIN_BEGIN_FIELDS(LOCKSTEP_DOC_ROW)
  out += "\n### `log`\n\n" + std::string(head);
  LOCKSTEP_STEP_LOG_FIELDS(LOCKSTEP_DOC_ROW)
  out += "\n### `eval`\n\n" + std::string(head);
  LOCKSTEP_EVAL_LOG_FIELDS(LOCKSTEP_DOC_ROW)
  out += "\n### `membership_change`\n\n" + std::string(head);
  LOCKSTEP_MEMBERSHIP_CHANGE_FIELDS(LOCKSTEP_DOC_ROW)
  out += "\n### `checkpoint`\n\n" + std::string(head);
  LOCKSTEP_CHECKPOINT_FIELDS(LOCKSTEP_DOC_ROW)
  return out;
}

}  // namespace lockstep::train::metrics
