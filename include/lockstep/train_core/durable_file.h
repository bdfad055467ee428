// Files that are either wholly there or not at all, and errors that name them.
//
// write_file_durably writes into a temporary sibling, flushes it to disk and renames it into
// place: a reader never sees half a file, a crash leaves the old one, and a full disk is a
// StorageError naming the path (the temporary is removed, the old file kept). Torch-free.
#pragma once

#include <cstddef>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

namespace lockstep::train {

// A file opened for writing (created, or truncated), closed when the object goes. Errors are
// throw_write_error's: a StorageError naming the path for a full disk.
class OutputFile {
 public:
  explicit OutputFile(std::string path);
  ~OutputFile();
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  // Writes some of `bytes` (retrying what a signal interrupts) and returns how many.
  std::size_t write_some(const void* data, std::size_t bytes);
  // fsync (then, with `drop_from_cache`, the advice that its pages may leave the page cache) and close.
  void sync_and_close(bool drop_from_cache = false);
  int fd() const { return fd_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

void write_file_durably(const std::string& path, std::string_view bytes);
// Renames directory `from` to `to` (a sibling). An existing `to` is swapped out in one step
// (renameat2's RENAME_EXCHANGE, then removed), so `to` names the old or the new directory at every
// moment, never nothing; where the file system cannot swap, it is moved aside just before.
void replace_directory(const std::string& from, const std::string& to);
// fsyncs a file or a directory (after creating or renaming entries in it).
void sync_path(const std::string& path);
// The whole file; DataError naming it (and `what` it should be) when it cannot be read.
std::string read_whole_file(const std::string& path, const std::string& what);
// The file parsed as JSON; DataError naming the file, the line and the problem when it is not.
nlohmann::json read_json_file(const std::string& path, const std::string& what);

}  // namespace lockstep::train
