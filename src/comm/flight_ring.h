// The communicator's side of the flight recorder (lockstep/comm/flight_recorder.h): a fixed
// ring of the last kFlightEntries collectives with their times. Not thread-safe: the
// communicator's queue mutex guards it. Recording stores the Collective as it is (no strings):
// the descriptions are built only when a record is published.
#pragma once

#include <array>

#include "backend.h"
#include "lockstep/comm/flight_recorder.h"

namespace lockstep::comm {

class FlightRing {
 public:
  void issued(const Collective& c, Clock::time_point at);
  void started(std::uint64_t sequence, Clock::time_point at);
  void finished(std::uint64_t sequence, Clock::time_point at);
  // The ring as a record, times measured back from `now`.
  FlightRecord record(int rank, const std::string& backend, Clock::time_point now) const;

 private:
  struct Slot {
    Collective collective;
    Clock::time_point issued{}, started{}, finished{};
  };
  Slot* slot(std::uint64_t sequence);
  std::array<Slot, kFlightEntries> slots_{};
  std::uint64_t count_ = 0;  // collectives issued; the newest has sequence count_ - 1
};

}  // namespace lockstep::comm
