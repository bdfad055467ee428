#include "p2p_exchange.h"

#include <algorithm>
#include <cstdint>
#include <numeric>

#include "lockstep/error.h"

namespace lockstep::testing {
namespace {

using comm::Communicator;
using comm::DType;

struct Check {
  std::vector<std::string> failures;
  int rank;
  void expect(bool ok, const std::string& what) {
    if (!ok) failures.push_back("rank " + std::to_string(rank) + ": " + what);
  }
};

// Each rank sends three messages to the next: two with tag 5, then one with tag 7. The next
// rank asks for tag 7 first: tags are matched apart, and within a tag the order is kept.
void tags_keep_their_order(Communicator& comm, Check& check) {
  const int w = comm.size(), next = (comm.rank() + 1) % w, prev = (comm.rank() + w - 1) % w;
  std::int64_t out[3][2] = {{comm.rank(), 1}, {comm.rank(), 2}, {comm.rank(), 3}}, in[3][2] = {};
  auto s1 = comm.send(out[0], 2, DType::i64, next, 5);
  auto s2 = comm.send(out[1], 2, DType::i64, next, 5);
  auto s3 = comm.send(out[2], 2, DType::i64, next, 7);
  auto r7 = comm.recv(in[2], 2, DType::i64, prev, 7);
  auto r5a = comm.recv(in[0], 2, DType::i64, prev, 5);
  auto r5b = comm.recv(in[1], 2, DType::i64, prev, 5);
  for (auto& work : {s1, s2, s3, r7, r5a, r5b}) work->wait();
  for (int k = 0; k < 3; ++k)
    check.expect(in[k][0] == prev && in[k][1] == k + 1,
                 "ring message " + std::to_string(k + 1) + " came as (" + std::to_string(in[k][0]) + ", " +
                     std::to_string(in[k][1]) + ")");
  check.expect(r7->source_rank() == prev, "recv from rank " + std::to_string(prev) + " reports source " +
                                              std::to_string(r7->source_rank()));
}

// Rank 0 takes one message from each other rank, from any source, and learns whose it was.
void any_source_names_the_sender(Communicator& comm, Check& check) {
  const std::size_t n = 1000;
  if (comm.rank() != 0) {
    std::vector<double> mine(n, comm.rank());
    comm.send(mine.data(), n, DType::f64, 0, 11)->wait();
    return;
  }
  std::vector<std::vector<double>> got(static_cast<std::size_t>(comm.size() - 1), std::vector<double>(n, -1));
  std::vector<comm::WorkPtr> works;
  for (auto& g : got) works.push_back(comm.recv(g.data(), n, DType::f64, Communicator::kAnySource, 11));
  std::vector<int> sources;
  for (std::size_t i = 0; i < works.size(); ++i) {
    works[i]->wait();
    const int s = works[i]->source_rank();
    sources.push_back(s);
    check.expect(std::all_of(got[i].begin(), got[i].end(), [&](double v) { return v == s; }),
                 "any-source recv " + std::to_string(i) + " says rank " + std::to_string(s) +
                     " but holds another rank's data");
  }
  std::sort(sources.begin(), sources.end());
  std::vector<int> want(static_cast<std::size_t>(comm.size() - 1));
  std::iota(want.begin(), want.end(), 1);
  check.expect(sources == want, "any-source recvs did not come once from each other rank");
}

// Pairs (0,1), (2,3)... send 4 MiB to each other at the same moment, sends before recvs.
void large_messages_cross(Communicator& comm, Check& check) {
  const int peer = comm.rank() ^ 1;
  if (peer >= comm.size()) return;
  const std::size_t n = std::size_t{1} << 20;
  std::vector<float> out(n), in(n, -1.0f);
  for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(comm.rank() * 7 + static_cast<int>(i % 1013));
  auto s = comm.send(out.data(), n, DType::f32, peer, 1);
  auto r = comm.recv(in.data(), n, DType::f32, peer, 1);
  s->wait();
  r->wait();
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < n; ++i) wrong += in[i] != static_cast<float>(peer * 7 + static_cast<int>(i % 1013));
  check.expect(wrong == 0, std::to_string(wrong) + " of the 4 MiB exchanged with rank " + std::to_string(peer) +
                               " are wrong");
}

void to_itself_and_empty(Communicator& comm, Check& check) {
  std::int32_t out = 40 + comm.rank(), in = 0;
  comm.send(&out, 1, DType::i32, comm.rank(), 3)->wait();
  comm.recv(&in, 1, DType::i32, comm.rank(), 3)->wait();
  check.expect(in == out, "a message to itself came back as " + std::to_string(in));
  const int next = (comm.rank() + 1) % comm.size(), prev = (comm.rank() + comm.size() - 1) % comm.size();
  auto s = comm.send(nullptr, 0, DType::f32, next, 4);
  auto r = comm.recv(nullptr, 0, DType::f32, prev, 4);
  s->wait();
  r->wait();
  check.expect(r->source_rank() == prev, "an empty message lost its source");
}

// Recvs posted before a collective do not hold it up; the sends come after it.
void recvs_pending_across_a_collective(Communicator& comm, Check& check) {
  const int next = (comm.rank() + 1) % comm.size(), prev = (comm.rank() + comm.size() - 1) % comm.size();
  std::int64_t in = -1, out = comm.rank(), sum = 1;
  auto r = comm.recv(&in, 1, DType::i64, prev, 13);
  comm.allreduce(&sum, 1, DType::i64, comm::ReduceOp::sum)->wait();
  check.expect(sum == comm.size(), "the allreduce under a pending recv gave " + std::to_string(sum));
  comm.send(&out, 1, DType::i64, next, 13)->wait();
  r->wait();
  check.expect(in == prev, "the recv after the allreduce got " + std::to_string(in));
}

// Rank 0 sends 4 elements where rank 1 expects 5: rank 1's recv fails naming both sizes.
void size_mismatch_is_named(Communicator& comm, Check& check) {
  if (comm.size() < 2 || comm.rank() > 1) return;
  std::int32_t buf[5] = {1, 2, 3, 4, 5};
  if (comm.rank() == 0) {
    comm.send(buf, 4, DType::i32, 1, 21)->wait();
    return;
  }
  try {
    comm.recv(buf, 5, DType::i32, 0, 21)->wait();
    check.expect(false, "a recv of 5 elements took a message of 4");
  } catch (const MismatchError& e) {
    const std::string what = e.what();
    check.expect(what.find("sent i32 x 4") != std::string::npos && what.find("expects i32 x 5") != std::string::npos,
                 "the mismatch error does not name both sizes: " + what);
  }
}

}  // namespace

std::vector<std::string> run_p2p_exchange(comm::Communicator& comm) {
  Check check{{}, comm.rank()};
  tags_keep_their_order(comm, check);
  if (comm.size() > 1) any_source_names_the_sender(comm, check);
  large_messages_cross(comm, check);
  to_itself_and_empty(comm, check);
  recvs_pending_across_a_collective(comm, check);
  size_mismatch_is_named(comm, check);
  comm.barrier()->wait();  // nobody closes its mailbox while a peer still sends to it
  return check.failures;
}

}  // namespace lockstep::testing
