// The safetensors format: see safetensors.h.
#include "lockstep/train_core/safetensors.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <set>
#include <nlohmann/json.hpp>

#include "lockstep/error.h"
#include "lockstep/train_core/json_integer.h"
#include "lockstep/train_core/durable_file.h"

namespace lockstep::train {
namespace {

constexpr std::uint64_t kMaxHeaderBytes = 100u << 20;  // Hugging Face's reader refuses larger ones too

std::uint64_t read_le64(const char* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<unsigned char>(p[i]);
  return v;
}

std::string le64(std::uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<std::size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xffu);
  return out;
}

struct Range {
  std::uint64_t begin, end;
  std::string tensor;
};

// One header entry: {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}.
SafeTensor parse_entry(const std::string& tensor, const nlohmann::json& entry, std::string_view data,
                       std::vector<Range>& ranges) {
  SafeTensor t;
  t.dtype = entry.at("dtype").get<std::string>();
  t.shape = json_integers<std::int64_t>(entry.at("shape"), "the shape of '" + tensor + "'");
  const auto offsets = json_integers<std::uint64_t>(entry.at("data_offsets"), "the data_offsets of '" + tensor + "'");
  if (offsets.size() != 2) throw DataError("data_offsets of '" + tensor + "' is not [begin, end]");
  std::int64_t numel = 1;
  for (auto d : t.shape)
    if (d < 0 || __builtin_mul_overflow(numel, d, &numel))
      throw DataError("tensor '" + tensor + "' has an impossible shape");
  const std::uint64_t begin = offsets[0], end = offsets[1];
  if (begin > end || end > data.size())
    throw DataError("tensor '" + tensor + "' lies at bytes [" + std::to_string(begin) + ", " + std::to_string(end) +
                    ") of a data section of " + std::to_string(data.size()) + " bytes (the file is truncated?)");
  std::uint64_t expected = 0;  // a count whose bytes wrap 64 bits would otherwise pass for a small one
  if (__builtin_mul_overflow(static_cast<std::uint64_t>(numel), safetensors_element_size(t.dtype), &expected))
    throw DataError("tensor '" + tensor + "' has an impossible shape: its bytes overflow 64 bits");
  if (end - begin != expected)
    throw DataError("tensor '" + tensor + "' holds " + std::to_string(end - begin) + " bytes, but its shape and dtype " +
                    t.dtype + " need " + std::to_string(expected));
  t.bytes = data.substr(begin, end - begin);
  ranges.push_back({begin, end, tensor});
  return t;
}

// The tensors tile the data section exactly, as Hugging Face's reader demands: no two share a
// byte, and no byte lies between or after them (a file with bytes nobody names was not written
// whole, or was written to hide them).
void refuse_overlaps_and_gaps(std::vector<Range> ranges, std::uint64_t data_bytes) {
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) { return a.begin < b.begin; });
  std::uint64_t covered = 0;
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    if (ranges[i].begin < covered)
      throw DataError("tensors '" + ranges[i - 1].tensor + "' and '" + ranges[i].tensor + "' share bytes");
    if (ranges[i].begin > covered)
      throw DataError("bytes [" + std::to_string(covered) + ", " + std::to_string(ranges[i].begin) +
                      ") of the data belong to no tensor (before '" + ranges[i].tensor + "')");
    covered = ranges[i].end;
  }
  if (covered != data_bytes)
    throw DataError(std::to_string(data_bytes - covered) + " bytes follow the last tensor's data (" +
                    std::to_string(data_bytes) + " bytes of data, tensors up to byte " + std::to_string(covered) + ")");
}

// The header, refusing a name given twice (JSON parsers keep one of the two silently).
nlohmann::json parse_header(const std::string& bytes, std::uint64_t header_bytes) {
  std::set<std::string> names;
  const auto once = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (depth == 1 && event == nlohmann::json::parse_event_t::key && !names.insert(parsed.get<std::string>()).second)
      throw DataError("its header names '" + parsed.get<std::string>() + "' twice");
    return true;
  };
  const auto begin = bytes.begin() + 8;
  return nlohmann::json::parse(begin, begin + static_cast<std::ptrdiff_t>(header_bytes), once);
}

}  // namespace

std::int64_t SafeTensor::numel() const {
  std::int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::size_t safetensors_element_size(const std::string& dtype) {
  static const std::map<std::string, std::size_t> sizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"U64", 8}, {"I32", 4},
      {"U32", 4}, {"I16", 2}, {"U16", 2}, {"I8", 1},   {"U8", 1},  {"BOOL", 1}};
  const auto it = sizes.find(dtype);
  if (it == sizes.end()) throw DataError("safetensors dtype '" + dtype + "' is not one lockstep reads");
  return it->second;
}

SafetensorsFile::SafetensorsFile(std::string bytes, std::string name)
    : bytes_(std::make_unique<const std::string>(std::move(bytes))), name_(std::move(name)) {
  const std::string& b = *bytes_;
  try {
    if (b.size() < 8) throw DataError("it is shorter than the 8-byte header length");
    const std::uint64_t header_bytes = read_le64(b.data());
    if (header_bytes > kMaxHeaderBytes || header_bytes > b.size() - 8)
      throw DataError("its header claims " + std::to_string(header_bytes) + " bytes of a " +
                      std::to_string(b.size()) + "-byte file");
    const auto header = parse_header(b, header_bytes);
    if (!header.is_object()) throw DataError("its header is not a JSON object");
    const std::string_view data = std::string_view(b).substr(8 + header_bytes);
    std::vector<Range> ranges;
    for (const auto& [key, value] : header.items()) {
      if (key == "__metadata__") {
        metadata_ = value.get<std::map<std::string, std::string>>();
        continue;
      }
      tensors_.emplace(key, parse_entry(key, value, data, ranges));
    }
    refuse_overlaps_and_gaps(std::move(ranges), data.size());
  } catch (const nlohmann::json::exception& e) {
    throw DataError(name_ + " is not a safetensors file: its header is malformed (" + e.what() + ")");
  } catch (const DataError& e) {
    throw DataError(name_ + " is not a valid safetensors file: " + e.what());
  }
}

const SafeTensor& SafetensorsFile::at(const std::string& tensor) const {
  const auto it = tensors_.find(tensor);
  if (it == tensors_.end()) throw DataError(name_ + " has no tensor '" + tensor + "'");
  return it->second;
}

SafetensorsFile read_safetensors(const std::string& path) {
  return SafetensorsFile(read_whole_file(path, "a safetensors file"), path);
}

SafetensorsDir::SafetensorsDir(const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path single = fs::path(dir) / "model.safetensors", index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(single))
    add(std::make_unique<SafetensorsFile>(read_safetensors(single.string())), single.string());
  else if (fs::exists(index))
    read_shards(dir, index.string());
  else
    throw DataError(dir + " holds no model.safetensors (nor an index of shards)" +
                    (fs::exists(fs::path(dir) / "pytorch_model.bin")
                         ? ": only pytorch_model.bin, a pickle; save it again with safe_serialization=True"
                         : std::string()));
}

void SafetensorsDir::read_shards(const std::string& dir, const std::string& index) {
  namespace fs = std::filesystem;
  std::map<std::string, std::string> shard_of;  // tensor -> shard, as the index maps them
  try {
    const auto weight_map = read_json_file(index, "a safetensors index").at("weight_map");
    if (!weight_map.is_object()) throw DataError(index + " is not an index of safetensors shards: no weight_map object");
    for (const auto& [tensor, shard] : weight_map.items()) shard_of[tensor] = shard.get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    throw DataError(index + " is not an index of safetensors shards: " + e.what());
  }
  std::set<std::string> shards;
  for (const auto& [tensor, shard] : shard_of) {
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..")
      throw DataError(index + " maps '" + tensor + "' to '" + shard + "', which is not a file beside it");
    shards.insert(shard);
  }
  for (const auto& shard : shards) {
    const std::string path = (fs::path(dir) / shard).string();
    if (!fs::exists(path)) throw DataError(index + " lists the shard " + shard + ", which is not in " + dir);
    add(std::make_unique<SafetensorsFile>(read_safetensors(path)), path);
  }
  for (const auto& [tensor, shard] : shard_of)
    if (!tensors_.count(tensor))
      throw DataError(index + " maps '" + tensor + "' to " + shard + ", which does not hold it");
}

void SafetensorsDir::add(std::unique_ptr<SafetensorsFile> file, const std::string& path) {
  for (const auto& [name, t] : file->tensors()) {
    if (!tensors_.emplace(name, &t).second)
      throw DataError("'" + name + "' is in both " + file_of_.at(name) + " and " + path + ": which is meant?");
    file_of_[name] = path;
  }
  files_.push_back(std::move(file));
}

std::string encode_safetensors(const std::vector<std::pair<std::string, SafeTensor>>& tensors,
                               const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::uint64_t offset = 0;
  for (const auto& [name, t] : tensors) {
    const auto expected = static_cast<std::uint64_t>(t.numel()) * safetensors_element_size(t.dtype);
    if (t.bytes.size() != expected)
      throw ConfigError("tensor '" + name + "' has " + std::to_string(t.bytes.size()) + " bytes for a shape that needs " +
                        std::to_string(expected));
    if (name == "__metadata__" || header.contains(name)) throw ConfigError("tensor name '" + name + "' is taken");
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + expected}}};
    offset += expected;
  }
  std::string json = header.dump();
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out = le64(json.size()) + json;
  out.reserve(out.size() + offset);
  for (const auto& entry : tensors) out.append(entry.second.bytes);
  return out;
}

void write_safetensors(const std::string& path, const std::vector<std::pair<std::string, SafeTensor>>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  write_file_durably(path, encode_safetensors(tensors, metadata));
}

}  // namespace lockstep::train
