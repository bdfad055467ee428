#include "lockstep/train_core/durable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lockstep/error.h"

namespace lockstep::train {
namespace {

// Closes the descriptor and, unless released, removes the temporary file.
class TempFile {
 public:
  explicit TempFile(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw_write_error(path_, errno);
  }
  ~TempFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!kept_) ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  void write_all(std::string_view bytes) {
    std::size_t done = 0;
    while (done < bytes.size()) {
      ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw_write_error(path_, errno);
      done += static_cast<std::size_t>(n);
    }
    if (::fsync(fd_) != 0) throw_write_error(path_, errno);
    if (::close(fd_) != 0) {
      fd_ = -1;
      throw_write_error(path_, errno);
    }
    fd_ = -1;
  }
  void keep() { kept_ = true; }

 private:
  std::string path_;
  int fd_ = -1;
  bool kept_ = false;
};

}  // namespace

void write_file_durably(const std::string& path, std::string_view bytes) {
  TempFile tmp(path + ".tmp");
  tmp.write_all(bytes);
  if (::rename((path + ".tmp").c_str(), path.c_str()) != 0) throw_write_error(path, errno);
  tmp.keep();
}

void replace_directory(const std::string& from, const std::string& to) {
  namespace fs = std::filesystem;
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) {
    std::error_code ignored;
    fs::remove_all(from, ignored);  // the old directory, now under the temporary name
    return;
  }
  if (errno != ENOENT && errno != EINVAL && errno != ENOSYS) throw_write_error(to, errno);
  std::error_code ec;
  const fs::path aside = fs::path(to).parent_path() / (".tmp-old-" + fs::path(to).filename().string() + "-" +
                                                       std::to_string(::getpid()));
  if (fs::exists(to)) fs::rename(to, aside, ec);
  if (!ec) fs::rename(from, to, ec);
  std::error_code ignored;
  fs::remove_all(aside, ignored);
  if (ec) throw_write_error(to, ec.value());
}

void sync_path(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw SystemError("cannot open " + path + " to flush it: " + std::strerror(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) throw_write_error(path, err);
}

std::string read_whole_file(const std::string& path, const std::string& what) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError("cannot read " + path + " (" + what + "): " + std::strerror(errno));
  std::ostringstream all;
  all << in.rdbuf();
  return all.str();
}

nlohmann::json read_json_file(const std::string& path, const std::string& what) {
  const std::string text = read_whole_file(path, what);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    // e.byte is where parsing stopped: name the line, so the user can look.
    std::size_t line = 1;
    for (std::size_t i = 0; i < e.byte && i < text.size(); ++i) line += text[i] == '\n';
    throw DataError(path + " (" + what + ") is not valid JSON at line " + std::to_string(line) +
                    ": the file is damaged; restore it, or start from another checkpoint");
  } catch (const nlohmann::json::exception& e) {  // a number too large for any type, say
    throw DataError(path + " (" + what + ") is not JSON lockstep can read (" + e.what() +
                    "): the file is damaged; restore it, or start from another checkpoint");
  }
}

}  // namespace lockstep::train
