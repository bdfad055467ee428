#include "lockstep/comm/collectives.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace lockstep::comm {

std::vector<std::string> allgather_strings(Communicator& comm, const std::string& mine) {
  const auto world = static_cast<std::size_t>(comm.size());
  std::int64_t length = static_cast<std::int64_t>(mine.size());
  std::vector<std::int64_t> lengths(world);
  comm.allgather(&length, lengths.data(), 1, DType::i64)->wait();
  const auto longest = static_cast<std::size_t>(*std::max_element(lengths.begin(), lengths.end()));
  const std::size_t words = (longest + 3) / 4;  // sent as int32 words
  std::vector<std::int32_t> send(words, 0), recv(words * world, 0);
  std::memcpy(send.data(), mine.data(), mine.size());
  comm.allgather(send.data(), recv.data(), words, DType::i32)->wait();
  std::vector<std::string> out;
  for (std::size_t r = 0; r < world; ++r)
    out.emplace_back(reinterpret_cast<const char*>(recv.data() + r * words),
                     static_cast<std::size_t>(lengths[r]));
  return out;
}

}  // namespace lockstep::comm
