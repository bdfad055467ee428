// The flight recorder: what each rank was doing with its collectives when a job stalled or
// failed.
//
// Every Communicator keeps the last kFlightEntries collectives it was asked for (sequence
// number, what, and when each was issued, started and finished), always on: a few kilobytes
// and a lock it already takes. It publishes them on the store under flight_key() only when
// something is wrong: a collective in flight, or this rank idle, for longer than peer_check,
// or a collective that failed. In the steady state it costs the store nothing.
//
// Readers: a backend whose collective stalls compares the peers' records with its own (who is
// behind, who issued something else at the same position); lockstep run prints every rank's
// record when a job fails, so the report says which rank was behind, at which collective, doing
// what.
//
// Thread-safety: FlightRecord is a value; the functions are pure or take the store client,
// which is safe to share.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/comm/store.h"

namespace lockstep::comm {

inline constexpr std::size_t kFlightEntries = 64;

struct FlightEntry {
  std::uint64_t sequence = 0;
  std::string what;             // "allreduce #12 (f32 x 1000, sum)"
  std::uint64_t signature = 0;  // the fields all ranks must agree on (Collective::signature)
  // Seconds before the record was published: when the collective was issued, started and
  // finished (negative: not yet).
  double issued_ago = -1, started_ago = -1, finished_ago = -1;
  bool in_flight() const { return started_ago >= 0 && finished_ago < 0; }
};

struct FlightRecord {
  int rank = 0;
  std::string backend;
  double published_at = 0;  // wall-clock seconds since the epoch, to age the record when read
  std::string error;        // the error that broke the communicator, if any
  std::vector<FlightEntry> recent;  // oldest first

  // The entry for `sequence`, if still in the ring.
  const FlightEntry* find(std::uint64_t sequence) const;
  // "in allreduce #12 (f32 x 1000, sum) for 5.2 s", "idle for 5.2 s since allreduce #11
  // (...) finished", "failed in allreduce #12 (...) after 3 s: <error>" or "no collective
  // issued yet", aged to `now` (wall-clock seconds).
  std::string doing(double now) const;
  std::string to_json() const;
  static FlightRecord from_json(const std::string& text);
};

// The store key of `rank`'s record in the communicator called `communicator` (its full name,
// e.g. "run/default/0/default" as the rendezvous names it).
std::string flight_key(const std::string& communicator, int rank);

// Every rank's published record, nullopt where a rank published none; bounded by the store
// client's own deadline.
std::vector<std::optional<FlightRecord>> read_flight_records(StoreClient& store, const std::string& communicator,
                                                             int size);

// One line per rank, "rank 1: idle for 300.0 s since allreduce #11 (...) finished", the ranks
// furthest behind first, for failure reports.
std::vector<std::string> describe_flight(const std::vector<std::optional<FlightRecord>>& records);

double wall_seconds_now();

}  // namespace lockstep::comm
