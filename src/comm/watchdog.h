// The communicator's watchdog: one thread per communicator that looks at its collectives' progress
// a few times per peer_check and acts only when something is wrong, so that in the steady state it
// costs neither the store nor the transport anything.
//   - A collective in flight, or the rank idle, for peer_check or longer (a stall), or a
//     communicator broken by an error: it publishes this rank's flight record on the store, once
//     per new state (flight_recorder.h).
//   - A collective in flight for peer_check or longer: it calls the backend's on_stall every tick,
//     which may abort the collective (a dead peer, a mismatch, the timeout).
// Threading: look() and record() are called on the watchdog's thread and must take the
// communicator's lock themselves; wake() may be called from any thread.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "backend.h"
#include "lockstep/comm/flight_recorder.h"

namespace lockstep::comm {

class Watchdog {
 public:
  // What the communicator shows the watchdog each tick.
  struct Look {
    bool in_flight = false;
    Collective collective;     // the one in flight, when in_flight
    Clock::time_point since;   // when the present state (this collective in flight, or idle) began
    std::uint64_t events = 0;  // starts and finishes so far: the state changed when this did
    std::string error;         // the error that broke the communicator, if any
  };
  struct Hooks {
    std::function<Look()> look;
    std::function<FlightRecord()> record;
  };

  Watchdog(std::shared_ptr<StoreClient> store, std::string record_key, Seconds stall_after, Backend& backend,
           Hooks hooks);
  ~Watchdog();  // stops the thread; a store call in progress ends within stall_after
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  void wake();  // look now (a collective failed)

 private:
  void loop();
  void tick();
  void publish(const Look& look);

  std::shared_ptr<StoreClient> store_;
  std::string record_key_;
  Seconds stall_after_;
  Backend& backend_;
  Hooks hooks_;
  std::uint64_t published_events_ = ~0ull;
  std::string published_error_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false, woken_ = false;
  std::thread thread_;
};

}  // namespace lockstep::comm
