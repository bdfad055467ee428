// Files that are either wholly there or not at all, and errors that name them.
//
// write_file_durably writes into a temporary sibling, flushes it to disk and renames it into
// place: a reader never sees half a file, a crash leaves the old one, and a full disk is a
// StorageError naming the path (the temporary is removed, the old file kept). Torch-free.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

namespace lockstep::train {

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
