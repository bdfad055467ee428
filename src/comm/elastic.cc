// ElasticGroup (lockstep/comm/elastic.h): memberships agreed through the store.
//
// Every change of membership, the first included, follows one pattern: the workers concerned
// announce themselves under the transition's key; the first to claim its leader key (a
// compare-and-set) collects them, decides the next epoch and publishes it; the others wait for
// that epoch, in short slices between which they check the leader is still alive, and clear the
// claim of a leader that died so that one of them takes over. Nobody waits for a worker that is
// gone (its ephemeral alive key vanished with its connection) or past the deadline.
#include "lockstep/base/clock.h"
#include "lockstep/comm/elastic.h"

#include <csignal>
#include <unistd.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <tuple>

#include "lockstep/base/knobs.h"
#include "lockstep/base/log.h"
#include "lockstep/base/run_env.h"
#include "lockstep/comm/rendezvous.h"
#include "store/wire.h"

namespace lockstep::comm {

using nlohmann::json;

namespace {

constexpr Seconds kSlice{0.2};  // between looks at a leader's liveness while waiting for it
constexpr Seconds kFormingLook{0.25};  // between looks at the members' liveness while a communicator forms

std::string host_name() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

json member_json(const Member& m) {
  return {{"id", m.id},     {"node", m.node}, {"local", m.local_rank}, {"local_world", m.local_world_size},
          {"host", m.host}, {"candidate", m.candidate}};
}

Member member_from(const json& j) {
  return Member{j.at("id").get<std::string>(),   j.at("node").get<int>(),
                j.at("local").get<int>(),        j.at("local_world").get<int>(),
                j.at("host").get<std::string>(), j.at("candidate").get<std::uint64_t>()};
}

// Machines all of whose workers are among `ms`.
int complete_machines(const std::vector<Member>& ms) {
  std::map<int, int> seen, expected;
  for (const auto& m : ms) {
    ++seen[m.node];
    expected[m.node] = m.local_world_size;
  }
  int n = 0;
  for (const auto& [node, count] : seen) n += count >= expected[node] ? 1 : 0;
  return n;
}

json members_json(const std::vector<Member>& ms) {
  json a = json::array();
  for (const auto& m : ms) a.push_back(member_json(m));
  return a;
}

std::vector<Member> members_from(const json& a) {
  std::vector<Member> out;
  for (const auto& j : a) out.push_back(member_from(j));
  return out;
}

// The first membership's ranks go machine by machine, local rank by local rank: ranks that share a
// machine are neighbours. Later ones keep the members that stay in their order, then add the
// joiners so: rank 0 stays with a member that holds the state (and writes the run's metrics)
// whenever one is left.
void sort_by_place(std::vector<Member>& ms) {
  std::sort(ms.begin(), ms.end(), [](const Member& a, const Member& b) {
    return std::tie(a.node, a.local_rank, a.candidate) < std::tie(b.node, b.local_rank, b.candidate);
  });
}

// The members of `a` that are not in `b`.
std::vector<Member> members_not_in(const std::vector<Member>& a, const std::vector<Member>& b) {
  std::vector<Member> out;
  for (const auto& m : a)
    if (std::none_of(b.begin(), b.end(), [&](const Member& o) { return o.id == m.id; })) out.push_back(m);
  return out;
}

}  // namespace

std::string describe_members(const std::vector<Member>& members) {
  std::string out;
  for (const auto& m : members)
    out += (out.empty() ? "" : "; ") + m.host + " machine " + std::to_string(m.node) + " local " +
           std::to_string(m.local_rank);
  return out.empty() ? "none" : out;
}

struct ElasticGroup::Epoch {
  std::uint64_t number = 0;
  std::vector<Member> members, left, joined;
  std::uint64_t admitted = 0;
  std::string reason;

  std::string to_json() const {
    return json{{"epoch", number},         {"members", members_json(members)}, {"left", members_json(left)},
                {"joined", members_json(joined)}, {"admitted", admitted},      {"reason", reason}}
        .dump();
  }
  static Epoch from_json(const std::string& text) {
    const json j = json::parse(text);
    Epoch e;
    e.number = j.at("epoch").get<std::uint64_t>();
    e.members = members_from(j.at("members"));
    e.left = members_from(j.at("left"));
    e.joined = members_from(j.at("joined"));
    e.admitted = j.at("admitted").get<std::uint64_t>();
    e.reason = j.at("reason").get<std::string>();
    return e;
  }
  bool includes(const std::string& id) const {
    return std::any_of(members.begin(), members.end(), [&](const Member& m) { return m.id == id; });
  }
};

ElasticGroup::ElasticGroup(std::shared_ptr<StoreClient> store, ElasticOptions options)
    : store_(std::move(store)), options_(std::move(options)) {
  if (options_.min_nodes < 1 || options_.max_nodes < options_.min_nodes)
    throw ConfigError("elastic membership needs 1 <= min nodes <= max nodes (got " +
                      std::to_string(options_.min_nodes) + ":" + std::to_string(options_.max_nodes) + ")");
  me_.node = options_.node;
  me_.local_rank = options_.local_rank;
  me_.local_world_size = options_.local_world_size;
  me_.host = options_.host.empty() ? host_name() : options_.host;
  me_.id = "n" + std::to_string(me_.node) + "l" + std::to_string(me_.local_rank) + "p" +
           std::to_string(::getpid()) + "-" + wire::hex(wire::random_bytes(3));
  register_candidate();
  const Epoch entered = wait_to_be_admitted();
  if (entered.number != admitted_epoch_) {  // it lost a member before its communicator was up
    MembershipChange c;
    c.epoch = entered.number;
    c.reason = entered.reason;
    c.left = members_not_in(admitted_members_, members_);
    c.joined = members_not_in(members_, admitted_members_);
    c.rebuild_seconds = last_build_seconds_;
    c.agree_seconds = seconds_since(first_failure_) - c.rebuild_seconds;
    start_change_ = c;
  }
}

ElasticGroup::~ElasticGroup() = default;

int ElasticGroup::nodes() const {
  std::set<int> n;
  for (const auto& m : members_) n.insert(m.node);
  return static_cast<int>(n.size());
}

Seconds ElasticGroup::agree_timeout() const {
  return std::max(options_.agree_floor, Seconds(3 * step_seconds_));
}

bool ElasticGroup::alive(const std::string& id) {
  return id == me_.id || store_->try_get(key("alive/" + id)).has_value();
}

// Also (re)asserts this worker's liveness: a worker cut off long enough for the store to drop its
// connection lost its ephemeral key with it.
void ElasticGroup::register_candidate() {
  store_->set_ephemeral(key("alive/" + me_.id), "1");
  me_.candidate = static_cast<std::uint64_t>(store_->add(key("candidates"), 1));
  store_->set(key("candidate/" + std::to_string(me_.candidate)), member_json(me_).dump());
}

// Candidates registered after number `after` that are still alive, in registration order. Stops at
// a number whose record is not written yet (its worker is between the two calls of
// register_candidate): that one and later ones wait for the next change.
std::vector<Member> ElasticGroup::live_candidates(std::uint64_t after) {
  const auto count = static_cast<std::uint64_t>(store_->add(key("candidates"), 0));
  std::vector<Member> out;
  for (std::uint64_t n = after + 1; n <= count; ++n) {
    auto text = store_->try_get(key("candidate/" + std::to_string(n)));
    if (!text) break;
    Member m = member_from(json::parse(*text));
    if (alive(m.id)) out.push_back(m);
  }
  return out;
}

// Waits for epoch `e` to be published. nullopt when its leader died first (its claim is cleared
// then, so the caller may claim the transition itself).
std::optional<ElasticGroup::Epoch> ElasticGroup::await_epoch(std::uint64_t e, const std::string& leader_key,
                                                             Clock::time_point deadline, bool candidate) {
  const std::string epoch_key = key("epoch/" + std::to_string(e));
  for (;;) {
    try {
      store_->wait({epoch_key}, kSlice);
      return Epoch::from_json(store_->get(epoch_key));
    } catch (const TimeoutError&) {
      if (candidate && store_->try_get(key("finished")))
        throw JobOver("run '" + options_.run_id + "' finished before this worker was admitted: nothing to do");
      if (Clock::now() >= deadline)
        throw TimeoutError("elastic: membership " + std::to_string(e) + " of run '" + options_.run_id +
                           "' was not published in time (its leader and every member that could lead are gone, "
                           "or the store is unreachable)");
      auto leader = store_->try_get(leader_key);
      if (leader && !leader->empty() && !alive(*leader)) {
        store_->compare_set(leader_key, *leader, "");
        return std::nullopt;
      }
    }
  }
}

// The first epoch: the candidate that claimed it waits for min_nodes machines, then for the settle
// time or max_nodes machines, and publishes every live candidate.
void ElasticGroup::lead_first_epoch() {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.join_timeout);
  std::optional<Clock::time_point> settled;
  std::vector<Member> cands;
  for (;;) {
    cands = live_candidates(0);
    const int n = complete_machines(cands);
    if (n >= options_.max_nodes) break;
    if (n >= options_.min_nodes && !settled)
      settled = Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.settle);
    if (settled && Clock::now() >= *settled) break;
    if (Clock::now() >= deadline)
      throw TimeoutError("elastic: only " + std::to_string(n) + " of at least " + std::to_string(options_.min_nodes) +
                         " machines joined run '" + options_.run_id + "' within " +
                         log::seconds_text(options_.join_timeout.count()) +
                         ": start a `lockstep run --nnodes MIN:MAX` on each machine");
    try {  // a new registration, or the next look
      store_->wait({key("candidate/" + std::to_string(cands.empty() ? 1 : cands.back().candidate + 1))}, kSlice);
    } catch (const TimeoutError&) {
    }
  }
  Epoch first;
  first.number = 0;
  first.members = cands;
  first.joined = cands;
  first.admitted = cands.back().candidate;
  first.reason = "start";
  sort_by_place(first.members);
  LOCKSTEP_LOG(debug, comm) << "elastic: publishing membership 0: " << first.to_json();
  store_->set(key("epoch/0"), first.to_json());
  store_->set(key("epoch"), "0");
}

ElasticGroup::Epoch ElasticGroup::wait_to_be_admitted() {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(options_.join_timeout);
  for (;;) {
    if (store_->try_get(key("finished")))
      throw JobOver("run '" + options_.run_id + "' finished before this worker was admitted: nothing to do");
    auto newest = store_->try_get(key("epoch"));
    std::optional<Epoch> next;
    if (!newest) {  // the first epoch is still forming: lead it, or wait for it
      const std::string leader_key = key("first/leader");
      if (store_->compare_set(leader_key, "", me_.id) == me_.id) lead_first_epoch();
      next = await_epoch(0, leader_key, deadline, /*candidate=*/true);
    } else {  // wait for the next change; lead it only when every member of the newest is gone
      const std::uint64_t e = std::stoull(*newest);
      const Epoch current = Epoch::from_json(store_->get(key("epoch/" + std::to_string(e))));
      if (current.includes(me_.id)) {
        joined_epoch_ = e;  // it formed between this worker's registration and its first look
        return enter(current);
      }
      const std::string leader_key = key("next/" + std::to_string(e) + "/leader");
      const bool orphaned =
          std::none_of(current.members.begin(), current.members.end(), [&](const Member& m) { return alive(m.id); });
      if (orphaned && store_->compare_set(leader_key, "", me_.id) == me_.id) {
        members_ = current.members;
        admitted_ = current.admitted;
        lead_transition(e, "the members of membership " + std::to_string(e) + " are all gone");
      }
      next = await_epoch(e + 1, leader_key, deadline, /*candidate=*/true);
    }
    if (next && next->includes(me_.id)) {
      joined_epoch_ = next->number;
      return enter(*next);
    }
    if (next)
      LOCKSTEP_LOG(debug, comm) << "elastic: " << me_.id << " is not in membership " << next->number << ": "
                                << next->to_json();
    if (Clock::now() >= deadline)
      throw TimeoutError("elastic: this worker was not admitted into run '" + options_.run_id + "' within " +
                         log::seconds_text(options_.join_timeout.count()));
  }
}

// The leader of the change out of epoch `from`: waits for each member to announce itself, to be
// gone, or for the deadline; then publishes the survivors and the live candidates.
void ElasticGroup::lead_transition(std::uint64_t from, const std::string& reason) {
  const std::string here = key("next/" + std::to_string(from) + "/here/");
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(agree_timeout());
  std::vector<Member> waiting;
  for (const auto& m : members_)
    if (m.id != me_.id) waiting.push_back(m);
  while (!waiting.empty() && Clock::now() < deadline) {
    std::vector<Member> still;
    for (const auto& m : waiting)
      if (!store_->try_get(here + m.id) && alive(m.id)) still.push_back(m);
    waiting = still;
    if (waiting.empty()) break;
    try {  // short: the member waited on may be the one that is gone
      store_->wait({here + waiting.front().id}, Seconds(0.02));
    } catch (const TimeoutError&) {
    }
  }
  Epoch next;
  next.number = from + 1;
  next.reason = reason;
  for (const auto& m : members_) {
    const bool announced = m.id == me_.id || store_->try_get(here + m.id).has_value();
    (announced ? next.members : next.left).push_back(m);
  }
  // After finish() (the members evaluate or write their results) nobody is admitted any more.
  if (!store_->try_get(key("finished"))) next.joined = live_candidates(admitted_);
  next.admitted = next.joined.empty() ? admitted_ : next.joined.back().candidate;
  sort_by_place(next.joined);
  next.members.insert(next.members.end(), next.joined.begin(), next.joined.end());
  store_->set(key("epoch/" + std::to_string(next.number)), next.to_json());
  store_->set(key("epoch"), std::to_string(next.number));
}

// Takes `epoch` as this worker's (its members, number and this worker's rank in it).
void ElasticGroup::take(const Epoch& epoch) {
  members_ = epoch.members;
  epoch_ = epoch.number;
  admitted_ = epoch.admitted;
  for (std::size_t i = 0; i < members_.size(); ++i)
    if (members_[i].id == me_.id) rank_ = static_cast<int>(i);
  if (admitted_members_.empty()) {
    admitted_members_ = epoch.members;
    admitted_epoch_ = epoch.number;
  }
}

// The members of the current epoch that are gone, described; "" when every one is there.
std::string ElasticGroup::members_gone() {
  std::vector<Member> gone;
  for (const auto& m : members_)
    if (!alive(m.id)) gone.push_back(m);
  if (gone.empty()) return "";
  return "elastic: " + describe_members(gone) + " left membership " + std::to_string(epoch_) +
         " while its communicator formed";
}

// Takes the published epoch as this worker's and builds its communicator; returns the epoch it
// entered. A member that dies before joining the communicator is noticed by the others' waits
// within a slice (WaitWatch): they agree on the next epoch and build that one, instead of waiting
// out the creation's timeout for a worker that will never come.
ElasticGroup::Epoch ElasticGroup::enter(Epoch epoch) {
  for (;;) {
    take(epoch);
    if (fault_requested("kill-before-communicator", static_cast<std::int64_t>(epoch_), rank_)) std::raise(SIGKILL);
    const auto build = Clock::now();
    try {
      CommOptions options = options_.comm;
      options.name = key("comm/" + std::to_string(epoch_));
      WaitWatch watch([this] { return members_gone(); }, kFormingLook);
      comm_ = Communicator::create(store_, rank_, size(), options);
      last_build_seconds_ = seconds_since(build);
      LOCKSTEP_LOG(debug, comm) << "elastic: membership " << epoch_ << ", rank " << rank_ << " of " << size();
      return epoch;
    } catch (const PeerError& e) {
      LOCKSTEP_LOG(warn, comm) << "elastic: the communicator of membership " << epoch_ << " did not form: " << e.what();
      if (first_failure_ == Clock::time_point{}) first_failure_ = Clock::now();
      const bool holds_nothing = joined_in_current_epoch() && epoch_ > 0;
      const Epoch next = agree_on_next(std::string("failure: ") + e.what());
      if (!next.includes(me_.id)) return rejoin(next);
      if (holds_nothing) joined_epoch_ = next.number;  // still a joiner: it never received the state
      epoch = next;
    }
  }
}

// The epoch after the current one, agreed with the other survivors: this worker announces itself,
// then leads the transition or waits for its leader (and takes over from one that dies).
ElasticGroup::Epoch ElasticGroup::agree_on_next(const std::string& reason) {
  const std::uint64_t from = epoch_;
  const std::string leader_key = key("next/" + std::to_string(from) + "/leader");
  store_->set(key("next/" + std::to_string(from) + "/here/" + me_.id), "1");
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(agree_timeout() + options_.join_timeout);
  std::optional<Epoch> next;
  while (!next) {
    if (store_->compare_set(leader_key, "", me_.id) == me_.id) lead_transition(from, reason);
    next = await_epoch(from + 1, leader_key, deadline, /*candidate=*/false);
  }
  return *next;
}

// Left out of `next` (too late to announce itself): joins again as a new worker.
ElasticGroup::Epoch ElasticGroup::rejoin(const Epoch& next) {
  LOCKSTEP_LOG(warn, comm) << "elastic: left out of membership " << next.number
                           << " (too late to announce itself); joining again as a new worker";
  epoch_ = next.number;
  register_candidate();
  return wait_to_be_admitted();
}

MembershipChange ElasticGroup::change(const std::string& reason) {
  const auto start = Clock::now();
  comm_.reset();  // its peers blocked on it fail at once instead of at their next check
  const std::vector<Member> before = members_;
  const Epoch next = agree_on_next(reason);
  MembershipChange c;
  c.agree_seconds = seconds_since(start);
  const auto rebuild = Clock::now();
  const Epoch entered = next.includes(me_.id) ? enter(next) : rejoin(next);
  c.rebuild_seconds = seconds_since(rebuild);
  c.epoch = entered.number;
  c.reason = entered.number == next.number ? next.reason : next.reason + "; then " + entered.reason;
  c.left = members_not_in(before, members_);
  c.joined = members_not_in(members_, before);
  LOCKSTEP_LOG(debug, comm) << "elastic: membership " << c.epoch << " (" << size() << " workers on " << nodes()
                           << " machines) after " << c.reason << "; left: " << describe_members(c.left)
                           << "; joined: " << describe_members(c.joined);
  return c;
}

bool ElasticGroup::joiners_waiting() {
  std::int64_t waiting = 0;
  if (rank_ == 0) waiting = live_candidates(admitted_).empty() ? 0 : 1;
  comm_->allreduce(&waiting, 1, DType::i64, ReduceOp::max)->wait();
  return waiting > 0;
}

void ElasticGroup::finish() {
  store_->set(key("finished"), "1");
}

MembershipChange ElasticGroup::grow() {
  return change("join");
}

MembershipChange ElasticGroup::recover(const std::string& why) {
  return change("failure: " + why);
}

namespace {
// The bytes of `root` on every rank: their length, then the bytes as 32-bit words.
std::string broadcast_bytes(Communicator& comm, int root, std::string bytes) {
  std::int64_t n = static_cast<std::int64_t>(bytes.size());
  comm.broadcast(&n, 1, DType::i64, root)->wait();
  bytes.resize(static_cast<std::size_t>((n + 3) / 4 * 4));
  comm.broadcast(bytes.data(), bytes.size() / 4, DType::i32, root)->wait();
  bytes.resize(static_cast<std::size_t>(n));
  return bytes;
}
}  // namespace

double bring_up_to_date(ElasticGroup& group, ElasticState& state) {
  const auto begin = Clock::now();
  Communicator& comm = group.comm();
  const bool fresh = group.joined_in_current_epoch() && group.epoch() > 0;
  const std::int64_t mine = fresh ? -1 : state.completed_steps();
  std::int64_t newest_and_oldest[2] = {mine, -mine};  // max of both: the newest, and minus the oldest
  comm.allreduce(newest_and_oldest, 2, DType::i64, ReduceOp::max)->wait();
  const std::int64_t newest = newest_and_oldest[0];
  if (-newest_and_oldest[1] == newest) return seconds_since(begin);
  std::int32_t source = mine == newest ? comm.rank() : comm.size();
  comm.allreduce(&source, 1, DType::i32, ReduceOp::min)->wait();
  const std::string bytes = broadcast_bytes(comm, source, comm.rank() == source ? state.save() : "");
  if (comm.rank() != source) state.load(bytes);
  return seconds_since(begin);
}

void run_elastic(ElasticGroup& group, ElasticState& state, const ElasticLoop& loop) {
  auto change = [&](const std::function<MembershipChange()>& how) {
    loop.release();
    const MembershipChange c = how();
    bring_up_to_date(group, state);
    loop.changed(c);
  };
  // Starting in a later epoch, this worker meets members that run a change's collectives: those of a
  // running job admitting it, or others whose first epoch lost a member before its communicator was up.
  if (group.epoch() > 0) bring_up_to_date(group, state);
  for (;;) {
    try {
      if (!loop.step()) return;
      if (loop.check_every > 0 && state.completed_steps() % loop.check_every == 0 && group.joiners_waiting())
        change([&] { return group.grow(); });
    } catch (const ElasticError&) {
      throw;
    } catch (const StoreReplacedError&) {
      throw;
    } catch (const PeerError& e) {
      change([&] { return group.recover(e.what()); });
    } catch (const TimeoutError& e) {
      change([&] { return group.recover(e.what()); });
    }
  }
}

bool started_elastic(const std::map<std::string, std::string>& env) {
  return knobs::lookup(env, knobs::kElastic).has_value();
}

bool started_elastic() {
  return started_elastic(knobs::environment());
}

namespace {
int parse_whole(const std::string& name, const std::string& text) {
  std::size_t used = 0;
  int v = -1;
  try {
    v = std::stoi(text, &used);
  } catch (const std::exception&) {
  }
  if (used != text.size() || v < 0) throw ConfigError(name + "='" + text + "' is not a whole number");
  return v;
}
}  // namespace

ElasticSetup elastic_setup_from(const std::map<std::string, std::string>& env, CommOptions comm) {
  const auto machines = knobs::lookup(env, knobs::kElastic);
  if (!machines) throw ConfigError("LOCKSTEP_ELASTIC is not set: start elastic workers with lockstep run --nnodes MIN:MAX");
  // The store, token, run and timeouts are read as for any rank: as a job of one.
  auto plain = env;
  plain.erase(knobs::kElastic.name);
  plain[knobs::kRank.name] = "0";
  plain[knobs::kWorldSize.name] = "1";
  const RendezvousInfo info = rendezvous_info_from(plain);
  if (info.store_host.empty())
    throw ConfigError("LOCKSTEP_STORE_ADDR is not set: elastic workers meet on lockstep run's store");
  ElasticSetup s;
  const auto colon = machines->find(':');
  if (colon == std::string::npos)
    throw ConfigError("LOCKSTEP_ELASTIC='" + *machines + "' is not MIN:MAX (machines)");
  s.options.min_nodes = parse_whole(knobs::kElastic.name, machines->substr(0, colon));
  s.options.max_nodes = parse_whole(knobs::kElastic.name, machines->substr(colon + 1));
  s.options.run_id = info.run_id;
  s.options.node = parse_whole(knobs::kGroupRank.name, knobs::lookup(env, knobs::kGroupRank).value_or("0"));
  s.options.local_rank = parse_whole(knobs::kLocalRank.name, knobs::lookup(env, knobs::kLocalRank).value_or("0"));
  s.options.local_world_size =
      std::max(1, parse_whole(knobs::kLocalWorldSize.name, knobs::lookup(env, knobs::kLocalWorldSize).value_or("1")));
  s.options.comm = with_environment_defaults(std::move(comm), info);
  // A store call that does not answer in 30 s means the store is gone, and with it the job.
  s.store = std::make_shared<StoreClient>(StoreClientOptions{info.store_host, info.store_port, info.token,
                                                             std::min(info.timeout, Seconds(30))});
  return s;
}

std::unique_ptr<ElasticGroup> join_elastic_from_env(CommOptions comm) {
  ElasticSetup s = elastic_setup_from(knobs::environment(), std::move(comm));
  return std::make_unique<ElasticGroup>(s.store, s.options);
}

}  // namespace lockstep::comm
