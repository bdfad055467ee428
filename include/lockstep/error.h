// lockstep errors.
//
// Every failure that a user can cause or meet at run time (bad configuration, a dead peer, a
// deadline that passed, a full disk) surfaces as a typed exception derived from lockstep::Error.
// Its message says what happened, on which rank, and what to do about it. Internal invariants
// use assertions instead; an exception is never thrown for a bug in lockstep itself. Each type
// maps to one exit code of lockstep's programs (lockstep/base/main.h).
#pragma once

#include <stdexcept>
#include <string>

namespace lockstep {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Configuration that cannot work: a missing or inconsistent environment variable, an option
// out of range, ranks that disagree about the job. Fix the input and start again. (Exit 2.)
class ConfigError : public Error {
 public:
  using Error::Error;
};

// A data file or dataset that cannot be used as it is: missing, truncated, corrupt. (Exit 2.)
class DataError : public Error {
 public:
  using Error::Error;
};

// The store refused the connection because it did not prove knowledge of the run's token.
// (Exit 2.)
class AuthError : public Error {
 public:
  using Error::Error;
};

// Writing failed for lack of room or permission: the disk is full, over quota or read-only.
// The message names the path; what was there before is intact. A restart cannot help. (Exit 3.)
class StorageError : public Error {
 public:
  using Error::Error;
};

// A deadline passed before the operation completed. (Exit 1.)
class TimeoutError : public Error {
 public:
  using Error::Error;
};

// A peer died, closed its connection, or aborted; the job cannot go on with this communicator.
// (Exit 1.)
class PeerError : public Error {
 public:
  using Error::Error;
};

// The store this process joined is gone and another instance answers at its address (it
// restarted, or a previous job's store closed and a new one took the port): the keys this
// process set there are lost. Start over against the new store, or exit. (Exit 1.)
class StoreReplacedError : public PeerError {
 public:
  using PeerError::PeerError;
};

// Ranks issued different collectives (kind, size, dtype, op or root) at the same position in
// their sequence: a program bug that would otherwise hang or produce garbage. (Exit 1.)
class MismatchError : public Error {
 public:
  using Error::Error;
};

// Not a failure: this worker learned that its job is over before it had anything to do (an
// elastic job finished while the worker waited to be admitted). A program's main() under
// lockstep::run_main ends with one line and exit 0. (Exit 0.)
class JobOver : public Error {
 public:
  using Error::Error;
};

// An operating-system call failed in a way lockstep cannot recover from. (Exit 1.)
class SystemError : public Error {
 public:
  using Error::Error;
};

// The error for a failed write of `path` with errno `err`: a StorageError when the disk is
// full, over quota or read-only (ENOSPC, EDQUOT, EROFS), a SystemError otherwise.
[[noreturn]] void throw_write_error(const std::string& path, int err, const std::string& what_was_kept = "");

}  // namespace lockstep
