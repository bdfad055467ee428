// How every lockstep program ends: exit codes, and a main() wrapper that turns any exception
// into one clear line on stderr and the documented code (docs/exit-codes.md).
//
//   int main(int argc, char** argv) {
//     return lockstep::run_main(argc, argv, [&] { ...; return 0; });
//   }
//
// Codes: 0 success; 1 a failure at run time (a dead peer, a deadline, a bug); 2 the input is
// wrong (a flag, a file, the environment: ConfigError, DataError, AuthError); 3 the machine
// cannot hold the result (StorageError: the disk is full or read-only); 124 a --timeout
// passed; 128 + N killed by signal N. Codes 2 and 3 tell `lockstep run` that a restart cannot
// help: it does not restart on them.
#pragma once

#include <exception>
#include <functional>
#include <string>

namespace lockstep {

inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;
inline constexpr int kExitBadInput = 2;
inline constexpr int kExitNoStorage = 3;
inline constexpr int kExitTimeout = 124;
inline constexpr int kExitSignalBase = 128;

// The documented code for an exception (1 for anything that is not a lockstep::Error
// subclass named above).
int exit_code_for(const std::exception& e);
// Whether restarting the job could change the outcome of a worker that exited with `code`.
bool restart_can_help(int code);
// The first line of an exception's message: libtorch's errors append a C++ stack trace.
std::string first_line(const std::string& what);

// Runs `body` and returns its code; an exception becomes "PROGRAM: error: MESSAGE" on stderr
// and exit_code_for(it) (JobOver: "PROGRAM: MESSAGE" and 0). PROGRAM is argv[0]'s file name. Also makes an exception that escapes
// a thread or a destructor (std::terminate) print that one line and exit 1 instead of an abort
// with a stack trace.
int run_main(int argc, char** argv, const std::function<int()>& body);

}  // namespace lockstep
