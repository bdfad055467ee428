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

OutputFile::OutputFile(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw_write_error(path_, errno);
}

OutputFile::~OutputFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::size_t OutputFile::write_some(const void* data, std::size_t bytes) {
  for (;;) {
    const ssize_t n = ::write(fd_, data, bytes);
    if (n >= 0) return static_cast<std::size_t>(n);
    if (errno != EINTR) throw_write_error(path_, errno);
  }
}

void OutputFile::sync_and_close(bool drop_from_cache) {
  if (::fsync(fd_) != 0) throw_write_error(path_, errno);
  if (drop_from_cache) ::posix_fadvise(fd_, 0, 0, POSIX_FADV_DONTNEED);  // clean now: only advice
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) throw_write_error(path_, errno);
}

namespace {

// Removes the temporary file unless it was kept (renamed into place).
class TempFile {
 public:
  explicit TempFile(std::string path) : file_(std::move(path)) {}
  ~TempFile() {
    if (!kept_) ::unlink(file_.path().c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  void write_all(std::string_view bytes) {
    for (std::size_t done = 0; done < bytes.size();) done += file_.write_some(bytes.data() + done, bytes.size() - done);
    file_.sync_and_close();
  }
  void keep() { kept_ = true; }

 private:
  OutputFile file_;
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
