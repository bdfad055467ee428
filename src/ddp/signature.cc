#include "signature.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "lockstep/comm/collectives.h"
#include "lockstep/error.h"

namespace lockstep::ddp_detail {

std::string describe(const ParamSignature& p) {
  std::ostringstream out;
  out << "'" << p.name << "' " << p.dtype << "[";
  for (std::size_t i = 0; i < p.shape.size(); ++i) out << (i ? ", " : "") << p.shape[i];
  out << "]";
  return out.str();
}

// One parameter per line: name, tab, dtype, tab, dims separated by spaces. Names never hold tabs
// or newlines (torch joins module names with '.').
std::string serialize(const std::vector<ParamSignature>& params) {
  std::ostringstream out;
  for (auto& p : params) {
    out << p.name << '\t' << p.dtype << '\t';
    for (std::size_t i = 0; i < p.shape.size(); ++i) out << (i ? " " : "") << p.shape[i];
    out << '\n';
  }
  return out.str();
}

std::vector<ParamSignature> deserialize(const std::string& text) {
  std::vector<ParamSignature> params;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    ParamSignature p;
    auto tab1 = line.find('\t'), tab2 = line.find('\t', tab1 + 1);
    p.name = line.substr(0, tab1);
    p.dtype = line.substr(tab1 + 1, tab2 - tab1 - 1);
    std::istringstream dims(line.substr(tab2 + 1));
    std::int64_t d;
    while (dims >> d) p.shape.push_back(d);
    params.push_back(std::move(p));
  }
  return params;
}

void check_same_parameters(comm::Communicator& comm, const std::vector<ParamSignature>& mine) {
  if (comm.size() == 1) return;
  auto all = comm::allgather_strings(comm, serialize(mine));
  const auto reference = deserialize(all[0]);
  for (int r = 1; r < comm.size(); ++r) {
    if (all[r] == all[0]) continue;
    auto theirs = deserialize(all[r]);
    std::ostringstream m;
    m << "DistributedDataParallel: the ranks hold different models: ";
    std::size_t i = 0;
    while (i < reference.size() && i < theirs.size() && serialize({reference[i]}) == serialize({theirs[i]}))
      ++i;
    if (i < reference.size() && i < theirs.size()) {
      m << "parameter " << i << " is " << describe(reference[i]) << " on rank 0 but " << describe(theirs[i])
        << " on rank " << r;
    } else if (i < reference.size()) {
      m << "rank 0 has " << reference.size() << " parameters, rank " << r << " only " << theirs.size()
        << "; the first missing on rank " << r << " is " << describe(reference[i]);
    } else {
      m << "rank " << r << " has " << theirs.size() << " parameters, rank 0 only " << reference.size()
        << "; the first extra on rank " << r << " is " << describe(theirs[i]);
    }
    m << ". Every rank must build the same model (same layers, shapes and dtypes, in the same order) "
         "before wrapping it.";
    throw ConfigError(m.str());
  }
}

}  // namespace lockstep::ddp_detail
