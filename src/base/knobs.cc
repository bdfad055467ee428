#include "lockstep/base/knobs.h"

#include <cstdlib>

extern char** environ;

namespace lockstep::knobs {

std::optional<std::string> get(const Knob& knob) {
  // The one place in lockstep that reads a variable by name (see the header).
  if (const char* v = std::getenv(knob.name); v != nullptr && *v != '\0') return std::string(v);
  if (knob.default_value != nullptr) return std::string(knob.default_value);
  return std::nullopt;
}

bool is_set(const Knob& knob) {
  return std::getenv(knob.name) != nullptr;
}

Environment environment() {
  Environment env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    auto eq = kv.find('=');
    if (eq != std::string::npos) env.emplace(kv.substr(0, eq), kv.substr(eq + 1));
  }
  return env;
}

std::optional<std::string> lookup(const Environment& env, const Knob& knob) {
  auto it = env.find(knob.name);
  if (it == env.end() || it->second.empty()) return std::nullopt;
  return it->second;
}

namespace {

const char* group_heading(Group g) {
  switch (g) {
    case Group::job: return "The job (torchrun's names; `lockstep run` sets them)";
    case Group::scheduler:
      return "Schedulers (used when `RANK` is unset, in this order: mpirun, Slurm, SageMaker)";
    case Group::comm: return "lockstep's runtime";
    case Group::launch: return "Read by `lockstep run`";
    case Group::train: return "Read by the Trainer";
    case Group::libraries: return "Read by the libraries lockstep runs on";
  }
  return "";
}

}  // namespace

std::string markdown() {
  std::string out;
  for (Group g : {Group::job, Group::scheduler, Group::comm, Group::launch, Group::train, Group::libraries}) {
    out += "### " + std::string(group_heading(g)) + "\n\n| variable | default | meaning |\n|---|---|---|\n";
    for (const Knob* k : kAll) {
      if (k->group != g) continue;
      std::string def = k->default_value == nullptr             ? "—"
                        : std::string(k->default_value).empty() ? "empty"
                                                                : "`" + std::string(k->default_value) + "`";
      out += "| `" + std::string(k->name) + "` | " + def + " | " + k->meaning + " |\n";
    }
    out += "\n";
  }
  return out;
}

}  // namespace lockstep::knobs
