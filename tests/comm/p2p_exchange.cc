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

// Once connected, messages to a rank on the same machine go through shared memory (unless the
// communicator was asked for TCP), and to a rank on another machine over TCP.
void same_machine_pairs_share_memory(Communicator& comm, bool lanes_wanted, Check& check) {
  const int next = (comm.rank() + 1) % comm.size();
  if (next == comm.rank()) return;
  const auto& machine = comm.machine_of();
  const bool one_machine = !machine.empty() && machine[static_cast<std::size_t>(next)] == machine[static_cast<std::size_t>(comm.rank())];
  check.expect(comm.shares_memory_with(next) == (lanes_wanted && one_machine),
               std::string("messages to rank ") + std::to_string(next) + (one_machine ? " (same machine)" : " (another machine)") +
                   (comm.shares_memory_with(next) ? " go through shared memory" : " go over TCP") +
                   (lanes_wanted ? "" : " with shared memory turned off"));
}

// Described messages: each rank sends the next a message whose description gives its length
// (random-looking, up to 300 KiB, so that a lane wraps), twice: once to a recv posted before it
// and once to one posted after it arrived (a barrier between). A place that throws fails only its
// recv: the message after it still arrives. A plain recv does not take a described message.
void described_messages_land_where_placed(Communicator& comm, Check& check) {
  const int w = comm.size(), next = (comm.rank() + 1) % w, prev = (comm.rank() + w - 1) % w;
  const auto length = [](int rank, int k) { return static_cast<std::size_t>((rank * 7919 + k * 104729) % 76800 + 1); };
  const auto make = [](int rank, int k, std::size_t n) {
    std::vector<std::int32_t> v(n);
    for (std::size_t i = 0; i < n; ++i) v[i] = rank * 1000003 + k * 7 + static_cast<std::int32_t>(i);
    return v;
  };
  std::vector<std::vector<std::int32_t>> out, in(4);
  for (int k = 0; k < 4; ++k) out.push_back(make(comm.rank(), k, length(comm.rank(), k)));
  const auto place_into = [&in](int k) {
    return [&in, k](const std::string& description, std::size_t count, DType dtype) -> void* {
      if (dtype != DType::i32 || description != "n=" + std::to_string(count)) throw DataError("unexpected description");
      in[static_cast<std::size_t>(k)].resize(count);
      return in[static_cast<std::size_t>(k)].data();
    };
  };
  auto early = comm.recv_described(place_into(0), prev, 31);
  std::vector<comm::WorkPtr> sends;
  for (int k = 0; k < 4; ++k)
    sends.push_back(comm.send_described("n=" + std::to_string(out[k].size()), out[k].data(), out[k].size(), DType::i32, next, 31));
  for (auto& s : sends) s->wait();
  early->wait();
  comm.barrier()->wait();  // the other three were sent: most likely they arrive before their recvs
  auto refused = comm.recv_described([](const std::string&, std::size_t, DType) -> void* { throw DataError("no room"); },
                                     prev, 31);
  bool refused_failed = false;
  try {
    refused->wait();
  } catch (const DataError&) {
    refused_failed = true;
  }
  check.expect(refused_failed, "a recv_described whose place threw did not fail");
  comm.recv_described(place_into(2), prev, 31)->wait();
  std::int32_t plain[4];
  bool mismatch = false;
  try {
    comm.recv(plain, 4, DType::i32, prev, 31)->wait();
  } catch (const MismatchError&) {
    mismatch = true;
  }
  check.expect(mismatch, "a plain recv took a described message");
  for (int k : {0, 2})
    check.expect(in[static_cast<std::size_t>(k)] == make(prev, k, length(prev, k)),
                 "described message " + std::to_string(k) + " from rank " + std::to_string(prev) + " arrived wrong");
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

std::vector<std::string> run_p2p_exchange(comm::Communicator& comm, bool lanes_wanted) {
  Check check{{}, comm.rank()};
  tags_keep_their_order(comm, check);
  same_machine_pairs_share_memory(comm, lanes_wanted, check);
  described_messages_land_where_placed(comm, check);
  if (comm.size() > 1) any_source_names_the_sender(comm, check);
  large_messages_cross(comm, check);
  to_itself_and_empty(comm, check);
  recvs_pending_across_a_collective(comm, check);
  size_mismatch_is_named(comm, check);
  comm.barrier()->wait();  // nobody closes its mailbox while a peer still sends to it
  return check.failures;
}

}  // namespace lockstep::testing
