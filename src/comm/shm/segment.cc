#include "shm/segment.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "lockstep/comm/shm_segments.h"
#include "store/wire.h"

namespace lockstep::comm::shm {
namespace {

Mapping failed(const char* what, int error) {
  Mapping m;
  m.error = error;
  m.what = what;
  return m;
}

std::string mib(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1 << 20));
  return buf;
}

}  // namespace

std::string segment_name(const std::string& what) {
  return "/lockstep-" + std::to_string(::getpid()) + "-" + what + "-" + wire::hex(wire::random_bytes(8));
}

Mapping create_segment(const std::string& name, std::size_t bytes) {
  bytes = (std::max<std::size_t>(bytes, 1) + 4095) / 4096 * 4096;
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return failed("create", errno);
  int error = ::ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
  if (!error) error = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));  // returns the error
  void* base = error ? MAP_FAILED : ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const char* step = error ? "reserve" : "map";
  if (!error && base == MAP_FAILED) error = errno;
  ::close(fd);
  if (error) {
    ::shm_unlink(name.c_str());
    return failed(step, error);
  }
  return Mapping{base, bytes, 0, ""};
}

Mapping open_or_create_segment(const std::string& name, std::size_t bytes) {
  bytes = (std::max<std::size_t>(bytes, 1) + 4095) / 4096 * 4096;
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return failed("open", errno);
  int error = ::ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;  // the same size: no change
  if (!error) error = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  void* base = error ? MAP_FAILED : ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const char* step = error ? "reserve" : "map";
  if (!error && base == MAP_FAILED) error = errno;
  ::close(fd);
  if (error) return failed(step, error);
  return Mapping{base, bytes, 0, ""};
}

Mapping open_segment(const std::string& name, std::size_t bytes) {
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0) return failed("open", errno);
  struct stat st {};
  if (bytes == 0) bytes = ::fstat(fd, &st) == 0 ? static_cast<std::size_t>(st.st_size) : 0;
  void* base = bytes ? ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  const int error = bytes ? errno : EINVAL;
  ::close(fd);
  if (base == MAP_FAILED) return failed("map", error);
  return Mapping{base, bytes, 0, ""};
}

std::string describe_failure(const Mapping& m, const std::string& name, std::size_t bytes) {
  std::string text = "cannot " + m.what + " shared memory " + name + " of " + mib(static_cast<double>(bytes)) + ": " +
                     std::strerror(m.error);
  struct statvfs fs {};
  if ((m.error == ENOSPC || m.error == ENOMEM) && ::statvfs("/dev/shm", &fs) == 0)
    text += " (/dev/shm has " + mib(static_cast<double>(fs.f_bavail) * static_cast<double>(fs.f_frsize)) +
            " free: enlarge it, e.g. docker run --shm-size, or use fewer or smaller buffers)";
  return text;
}

}  // namespace lockstep::comm::shm

namespace lockstep::comm {

bool shm_segment_created_by(const std::string& file, int pid) {
  return file.rfind("lockstep-" + std::to_string(pid) + "-", 0) == 0;
}

int remove_shm_segments_of(const std::vector<int>& pids) {
  DIR* d = ::opendir("/dev/shm");
  if (!d) return 0;
  std::vector<std::string> doomed;
  while (dirent* e = ::readdir(d)) {
    const std::string file = e->d_name;
    for (int pid : pids)
      if (shm_segment_created_by(file, pid)) doomed.push_back(file);
  }
  ::closedir(d);
  int removed = 0;
  for (const auto& file : doomed) removed += ::shm_unlink(("/" + file).c_str()) == 0 ? 1 : 0;
  return removed;
}

}  // namespace lockstep::comm
