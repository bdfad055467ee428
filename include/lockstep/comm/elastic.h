// ElasticGroup: the workers of a job whose membership changes while it runs, and a communicator
// over whoever is in it now.
//
// A job is a sequence of memberships ("epochs"), each a list of workers in rank order with a
// communicator of its own. A worker joins by registering on the store as a candidate; the first
// epoch forms once workers of min_nodes machines registered (and a settle time passed, or
// max_nodes machines joined). Later candidates wait until the members admit them at a step
// boundary (joiners_waiting, then grow). When a collective fails because a member died or became
// unreachable, the survivors call recover(): they announce themselves on the store, one of them
// (the first to claim the transition; another takes over if it dies) waits until every member of
// the failed epoch either announced itself or is gone (its ephemeral liveness key vanished), or
// until the agreement deadline, and publishes the next epoch: the survivors and any candidates,
// ordered by (machine, local rank). Every member of it builds that epoch's communicator in the same
// process; nothing is restarted and nothing is read from disk. A member that dies before it joined
// its epoch's communicator (the first epoch's too) is noticed by the others while they wait for it
// to join (within a quarter of a second), and they agree on the next epoch the same way instead of
// waiting out the creation's timeout. A member left out (it was too late,
// or cut off) gets an ElasticError and may join again as a candidate.
//
// Store keys, under "elastic/<run_id>/": candidates (a counter), candidate/<n> (one per
// registration), alive/<id> (ephemeral), epoch (the newest epoch number), epoch/<e> (its
// membership, JSON), next/<e>/leader and next/<e>/here/<id> (the transition out of epoch e). The
// steady state reads none of them: a member looks for candidates only when joiners_waiting() is
// called, once per call on rank 0.
//
// The application's state is the caller's: after every change, bring_up_to_date() moves it from
// the member with the newest completed step to the others (the Trainer does this with the model,
// the optimizer state and the data position; run_elastic() is the whole loop for programs that
// write their own).
//
// Threading: one thread uses a group. Every blocking call is bounded by join_timeout (joining) or
// by the agreement deadline (changes).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lockstep/comm/communicator.h"
#include "lockstep/comm/store.h"
#include "lockstep/error.h"

namespace lockstep::comm {

// This worker is not in the job's membership any more: it was left out of an epoch (it did not
// announce itself in time, or was cut off from the others), or it gave up joining. (Exit 1.)
class ElasticError : public PeerError {
 public:
  using PeerError::PeerError;
};

struct ElasticOptions {
  std::string run_id = "default";  // names the group's keys on the store
  int node = 0;                    // the machine (launcher) this worker runs on
  int local_rank = 0;              // its index on that machine
  int local_world_size = 1;        // workers on that machine: a machine counts once all joined
  std::string host;                // named in reports; default: the host name
  int min_nodes = 1;               // the first epoch waits for workers of this many machines
  int max_nodes = 1;               // ... and forms at once when this many have joined
  Seconds settle{2};               // once min_nodes joined, how long the first epoch waits for more
  Seconds join_timeout{600};       // how long a worker waits to be admitted
  // The shortest time a change waits for the members of the failed epoch to announce themselves;
  // a member busy computing notices the failure only at its next collective, so the wait is also
  // at least 3 x the step time reported through set_step_seconds.
  Seconds agree_floor{2};
  CommOptions comm;  // for each epoch's communicator (its name is set per epoch)
};

struct Member {
  std::string id;  // unique per worker process
  int node = 0, local_rank = 0, local_world_size = 1;
  std::string host;
  std::uint64_t candidate = 0;  // its registration number
};

// "host machine 1 local 0; ..." ("none" when empty): how logs and metrics name members.
std::string describe_members(const std::vector<Member>& members);

// One change of membership, as every member of the new epoch sees it.
struct MembershipChange {
  std::uint64_t epoch = 0;  // the new one
  std::string reason;       // "join", or "failure: <the error that started it>"
  std::vector<Member> left, joined;
  double agree_seconds = 0;    // from the call to the new membership being known
  double rebuild_seconds = 0;  // building the new epoch's communicator
};

class ElasticGroup {
 public:
  // Registers as a candidate and blocks until this worker is a member of an epoch (the first, or a
  // later one that admits it) and that epoch's communicator is up. TimeoutError after
  // join_timeout; JobOver when the members finished the job (finish()) before admitting it.
  ElasticGroup(std::shared_ptr<StoreClient> store, ElasticOptions options);
  ~ElasticGroup();
  ElasticGroup(const ElasticGroup&) = delete;
  ElasticGroup& operator=(const ElasticGroup&) = delete;

  Communicator& comm() { return *comm_; }
  int rank() const { return rank_; }
  int size() const { return static_cast<int>(members_.size()); }
  std::uint64_t epoch() const { return epoch_; }
  const std::vector<Member>& members() const { return members_; }
  const Member& me() const { return me_; }
  int nodes() const;  // machines in the current epoch
  // Whether this worker became a member in the current epoch (it holds no state yet).
  bool joined_in_current_epoch() const { return joined_epoch_ == epoch_; }
  // Workers in the first membership this worker was admitted into: the first epoch's size for
  // the workers that formed it, even when it lost a member before its communicator was up.
  int first_membership_size() const { return static_cast<int>(admitted_members_.size()); }
  // When the membership this worker was admitted into at its start lost a member before its
  // communicator was up, the change from it to the membership the worker started in.
  const std::optional<MembershipChange>& start_change() const { return start_change_; }

  // The measured time of one step: changes wait at least three of them for busy members.
  void set_step_seconds(double seconds) { step_seconds_ = seconds; }

  // Collective on the current epoch (every member at the same step): whether candidates are
  // waiting to be admitted. One store read on rank 0 and a one-integer all-reduce.
  bool joiners_waiting();
  // Collective on the current epoch: admits the waiting candidates into the next epoch.
  MembershipChange grow();
  // After a collective of the current epoch failed (`why`): closes the current communicator, agrees
  // with the survivors on the next epoch and builds its communicator. Release everything that uses
  // comm() (buckets in its shared memory, pending Works) before calling. ElasticError when this
  // worker was left out; TimeoutError when no epoch was published in time.
  MembershipChange recover(const std::string& why);
  // The job is done (any member may call it, once its work is over): workers still waiting to be
  // admitted get JobOver instead of waiting for their timeout. The members can still recover from
  // a lost member (to finish an evaluation, say), among themselves.
  void finish();

 private:
  struct Epoch;
  void register_candidate();
  Epoch wait_to_be_admitted();
  MembershipChange change(const std::string& reason);
  Epoch agree_on_next(const std::string& reason);
  Epoch rejoin(const Epoch& next);
  void lead_first_epoch();
  void lead_transition(std::uint64_t from, const std::string& reason);
  // A candidate (not a member) gives up with JobOver once the job is finished.
  std::optional<Epoch> await_epoch(std::uint64_t e, const std::string& leader_key, Clock::time_point deadline,
                                   bool candidate);
  Epoch enter(Epoch epoch);
  void take(const Epoch& epoch);
  std::string members_gone();
  std::vector<Member> live_candidates(std::uint64_t after);
  bool alive(const std::string& id);
  Seconds agree_timeout() const;
  std::string key(const std::string& k) const { return "elastic/" + options_.run_id + "/" + k; }

  std::shared_ptr<StoreClient> store_;
  ElasticOptions options_;
  Member me_;
  std::vector<Member> members_;
  std::uint64_t epoch_ = 0, joined_epoch_ = 0;
  std::uint64_t admitted_ = 0;  // candidates numbered up to this were admitted or passed over
  int rank_ = 0;
  std::vector<Member> admitted_members_;  // of the first membership this worker was admitted into
  std::uint64_t admitted_epoch_ = 0;
  std::optional<MembershipChange> start_change_;
  double last_build_seconds_ = 0;  // the newest communicator's creation
  Clock::time_point first_failure_{};  // of a communicator that did not form, at the start
  double step_seconds_ = 0;
  std::unique_ptr<Communicator> comm_;
};

// What a member of an elastic job holds that a member behind needs (Horovod's hvd.elastic.State):
// the number of steps it completed, and its state as bytes. Implement it for your loop; the
// Trainer has its own (the model, the optimizer state, the data position).
class ElasticState {
 public:
  virtual ~ElasticState() = default;
  virtual std::int64_t completed_steps() const = 0;
  virtual std::string save() const = 0;
  virtual void load(const std::string& bytes) = 0;
};

// Collective on the group's current membership, after every change: the lowest-ranked member
// that completed the most steps broadcasts its state to the others, which load it (members that
// joined in this membership count as having none). Nothing moves when every member already
// completed the same steps (replicas that did are equal). Returns the seconds it took.
double bring_up_to_date(ElasticGroup& group, ElasticState& state);

// The loop of a program that trains elastically without the Trainer (Horovod's hvd.elastic.run):
// calls step() until it returns false. When a collective in it fails (PeerError, TimeoutError),
// the loop calls release() (drop everything that uses the old communicator: its shared buffers,
// pending Works), recovers the membership, brings every member up to date and goes on with step();
// the step in progress is taken again, so commit your state's step count only once a step is
// complete. Every `check_every` completed steps (the same count on every member) it admits
// workers waiting to join the same way. changed(c) is told of every change.
struct ElasticLoop {
  std::function<bool()> step;
  std::function<void()> release = [] {};
  std::function<void(const MembershipChange&)> changed = [](const MembershipChange&) {};
  std::int64_t check_every = 10;
};
void run_elastic(ElasticGroup& group, ElasticState& state, const ElasticLoop& loop);

// Whether lockstep run started this process as an elastic worker (LOCKSTEP_ELASTIC is set).
bool started_elastic();
bool started_elastic(const std::map<std::string, std::string>& env);

// What lockstep run --nnodes MIN:MAX gives an elastic worker: the store (LOCKSTEP_STORE_ADDR,
// LOCKSTEP_TOKEN), the run (LOCKSTEP_RUN_ID), its place (GROUP_RANK, LOCAL_RANK), the machines
// (LOCKSTEP_ELASTIC), LOCAL_WORLD_SIZE, and the communicator's settings (LOCKSTEP_BACKEND, LOCKSTEP_TIMEOUT,
// LOCKSTEP_PEER_CHECK, LOCKSTEP_CHECK_COLLECTIVES). ConfigError names a variable that is wrong.
struct ElasticSetup {
  std::shared_ptr<StoreClient> store;
  ElasticOptions options;
};
ElasticSetup elastic_setup_from(const std::map<std::string, std::string>& env, CommOptions comm = {});
// Joins with elastic_setup_from(the environment): blocks until admitted.
std::unique_ptr<ElasticGroup> join_elastic_from_env(CommOptions comm = {});

}  // namespace lockstep::comm
