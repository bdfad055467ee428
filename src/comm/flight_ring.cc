#include "flight_ring.h"

namespace lockstep::comm {

void FlightRing::issued(const Collective& c, Clock::time_point at) {
  Slot& s = slots_[c.sequence % kFlightEntries];
  s = Slot{c, at, {}, {}};
  count_ = c.sequence + 1;
}

FlightRing::Slot* FlightRing::slot(std::uint64_t sequence) {
  Slot& s = slots_[sequence % kFlightEntries];
  return sequence < count_ && s.collective.sequence == sequence ? &s : nullptr;
}

void FlightRing::started(std::uint64_t sequence, Clock::time_point at) {
  if (Slot* s = slot(sequence)) s->started = at;
}

void FlightRing::finished(std::uint64_t sequence, Clock::time_point at) {
  if (Slot* s = slot(sequence)) s->finished = at;
}

FlightRecord FlightRing::record(int rank, const std::string& backend, Clock::time_point now) const {
  FlightRecord r;
  r.rank = rank;
  r.backend = backend;
  r.published_at = wall_seconds_now();
  auto ago = [&](Clock::time_point t) { return t == Clock::time_point{} ? -1.0 : Seconds(now - t).count(); };
  const std::uint64_t first = count_ > kFlightEntries ? count_ - kFlightEntries : 0;
  for (std::uint64_t seq = first; seq < count_; ++seq) {
    const Slot& s = slots_[seq % kFlightEntries];
    r.recent.push_back(FlightEntry{seq, s.collective.describe(), s.collective.signature(), ago(s.issued),
                                   ago(s.started), ago(s.finished)});
  }
  return r;
}

}  // namespace lockstep::comm
