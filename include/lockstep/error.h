// lockstep errors.
//
// Every failure that a user can cause or meet at run time (bad configuration, a dead peer, a
// deadline that passed) surfaces as a typed exception derived from lockstep::Error. Its message
// says what happened, on which rank, and what to do about it. Internal invariants use
// assertions instead; an exception is never thrown for a bug in lockstep itself.
#pragma once

#include <stdexcept>
#include <string>

namespace lockstep {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Configuration that cannot work: a missing or inconsistent environment variable, an option
// out of range, ranks that disagree about the job. Fix the input and start again.
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A deadline passed before the operation completed.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A peer died, closed its connection, or aborted; the job cannot go on with this communicator.
class PeerError : public Error {
 public:
  using Error::Error;
};

// Ranks issued different collectives (kind, size, dtype, op or root) at the same position in
// their sequence: a program bug that would otherwise hang or produce garbage.
class MismatchError : public Error {
 public:
  using Error::Error;
};

// The store refused the connection because it did not prove knowledge of the run's token.
class AuthError : public Error {
 public:
  using Error::Error;
};

// An operating-system call failed in a way lockstep cannot recover from.
class SystemError : public Error {
 public:
  using Error::Error;
};

}  // namespace lockstep
