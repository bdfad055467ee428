// One direction of point-to-point between two ranks on one machine: a ring of bytes in a shared
// segment, written by the sending rank and read by a thread of the receiving rank, carrying the
// same byte stream a TCP connection would (mailbox.cc frames the messages). A message crosses in
// two copies that overlap: the writer publishes each chunk as soon as it is in the ring, and the
// reader copies it out into the recv's buffer while the writer fills the next one.
//
// Neither side trusts the other to stay alive: a wait for data or space sleeps on a futex in the
// segment for at most 50 ms at a time and asks its caller, between sleeps, whether to give up (the peer's TCP connection closed: mailbox.cc watches it). The reader still drains what
// the writer published before it died or exited.
#pragma once

#include <cstddef>
#include <functional>
#include <initializer_list>
#include <memory>
#include <string>

namespace lockstep::comm {

class ShmLane {
 public:
  // true: stop waiting (the peer is gone, or this rank is shutting down).
  using GiveUp = std::function<bool()>;

  // The writer's end: a new segment of `ring_bytes` (a power of two). nullptr with `error` set
  // when /dev/shm cannot hold it.
  static std::unique_ptr<ShmLane> create(std::size_t ring_bytes, std::string& error);
  // The reader's end of the lane the writer named. nullptr with `error` set when it cannot be mapped.
  static std::unique_ptr<ShmLane> open(const std::string& name, std::string& error);
  ~ShmLane();
  ShmLane(const ShmLane&) = delete;
  ShmLane& operator=(const ShmLane&) = delete;

  const std::string& name() const { return name_; }
  // Removes the name (both ends mapped it: the memory lives on until both unmap).
  void unlink();

  // Writer: copies one message's parts into the ring, publishing them chunk by chunk; false when
  // it gave up with bytes still to write.
  struct Part {
    const void* data;
    std::size_t bytes;
  };
  bool write(std::initializer_list<Part> parts, const GiveUp& give_up);
  // Reader: copies the next `n` bytes out; false when the ring is empty and give_up() says so.
  bool read(void* out, std::size_t n, const GiveUp& give_up);
  // Ends a reader's or writer's sleep now (so that it asks give_up() again).
  void wake();

  struct Control;  // in the segment

 private:
  ShmLane(std::string name, void* base, std::size_t bytes, bool owner);
  bool write_part(const void* data, std::size_t n, const GiveUp& give_up);
  std::string name_;
  void* base_;
  std::size_t bytes_;
  bool owner_;  // created the name (unlinks it if nobody did)
  Control* control_;
  unsigned char* ring_;
  std::size_t capacity_;
};

}  // namespace lockstep::comm
