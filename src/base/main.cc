#include "lockstep/base/main.h"

#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "lockstep/error.h"

namespace lockstep {
namespace {

std::string g_program = "lockstep";

void say_error(const std::string& message) {
  std::string out = g_program + ": error: " + message + "\n";
  ssize_t ignored = ::write(STDERR_FILENO, out.data(), out.size());
  (void)ignored;
}

[[noreturn]] void on_terminate() {
  if (auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      say_error(first_line(x.what()) + " (thrown where it could not be handled)");
      std::_Exit(exit_code_for(x));
    } catch (...) {
    }
  }
  say_error("terminated by an internal error");
  std::_Exit(kExitFailure);
}

}  // namespace

int exit_code_for(const std::exception& e) {
  if (dynamic_cast<const ConfigError*>(&e) || dynamic_cast<const DataError*>(&e) ||
      dynamic_cast<const AuthError*>(&e))
    return kExitBadInput;
  if (dynamic_cast<const StorageError*>(&e)) return kExitNoStorage;
  return kExitFailure;
}

bool restart_can_help(int code) {
  return code != kExitOk && code != kExitBadInput && code != kExitNoStorage;
}

std::string first_line(const std::string& what) {
  auto nl = what.find('\n');
  std::string line = nl == std::string::npos ? what : what.substr(0, nl);
  while (!line.empty() && (line.back() == ' ' || line.back() == '\r')) line.pop_back();
  return line;
}

int run_main(int argc, char** argv, const std::function<int()>& body) {
  if (argc > 0 && argv[0] != nullptr) {
    std::string p = argv[0];
    g_program = p.substr(p.rfind('/') == std::string::npos ? 0 : p.rfind('/') + 1);
  }
  std::set_terminate(on_terminate);
  try {
    return body();
  } catch (const JobOver& e) {
    std::fprintf(stderr, "%s: %s\n", g_program.c_str(), first_line(e.what()).c_str());
    return kExitOk;
  } catch (const std::exception& e) {
    say_error(first_line(e.what()));
    return exit_code_for(e);
  } catch (...) {
    say_error("an unknown exception ended the program");
    return kExitFailure;
  }
}

[[noreturn]] void throw_write_error(const std::string& path, int err, const std::string& what_was_kept) {
  std::string kept = what_was_kept.empty() ? "" : "; " + what_was_kept;
  switch (err) {
    case ENOSPC:
      throw StorageError("no space left on the device holding " + path + kept +
                         ": free some space (or point the output elsewhere) and run again");
    case EDQUOT:
      throw StorageError("disk quota exceeded writing " + path + kept + ": free some space and run again");
    case EROFS:
      throw StorageError(path + " is on a read-only file system" + kept + ": write somewhere writable");
    default: throw SystemError("cannot write " + path + ": " + std::strerror(err) + kept);
  }
}

}  // namespace lockstep
