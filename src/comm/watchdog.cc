#include "watchdog.h"

#include <algorithm>

#include "lockstep/base/log.h"
#include "lockstep/error.h"

namespace lockstep::comm {

Watchdog::Watchdog(std::shared_ptr<StoreClient> store, std::string record_key, Seconds stall_after,
                   Backend& backend, Hooks hooks)
    : store_(std::move(store)),
      record_key_(std::move(record_key)),
      stall_after_(stall_after),
      backend_(backend),
      hooks_(std::move(hooks)) {
  thread_ = std::thread([this] { loop(); });
}

Watchdog::~Watchdog() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void Watchdog::wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    woken_ = true;
  }
  cv_.notify_all();
}

// A few looks per stall_after, so a stall is seen within about 1.25 x stall_after.
void Watchdog::loop() {
  const auto every = std::clamp(std::chrono::duration_cast<Clock::duration>(stall_after_ / 4),
                                Clock::duration(std::chrono::milliseconds(10)),
                                Clock::duration(std::chrono::seconds(1)));
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait_for(lock, every, [&] { return stopping_ || woken_; });
    const bool stop = stopping_, woken = woken_;
    woken_ = false;
    lock.unlock();
    // A wake-up (a collective failed) is acted on even when the communicator is closing right
    // after it: the record of the failure is what the launcher reports.
    if (woken || !stop) tick();
    if (stop) return;
    lock.lock();
  }
}

void Watchdog::tick() {
  const Look look = hooks_.look();
  const Seconds state_for = Clock::now() - look.since;
  const bool stalled = state_for >= stall_after_;
  if (stalled || !look.error.empty()) publish(look);
  if (look.in_flight && stalled && look.error.empty()) {
    try {
      backend_.on_stall(look.collective, state_for);
    } catch (const std::exception& e) {
      LOCKSTEP_LOG(debug, comm) << "watchdog: " << e.what();
    }
  }
}

void Watchdog::publish(const Look& look) {
  if (look.events == published_events_ && look.error == published_error_) return;
  FlightRecord record = hooks_.record();
  record.error = look.error;
  try {
    store_->set(record_key_, record.to_json(), stall_after_);
    published_events_ = look.events;
    published_error_ = look.error;
  } catch (const Error& e) {
    LOCKSTEP_LOG(debug, comm) << "watchdog: could not publish the flight record: " << e.what();
  }
}

}  // namespace lockstep::comm
