// Elastic membership with real processes: a killed member is left out while the others go on in
// the same processes, and a worker that starts later is admitted at a step boundary.
#include "lockstep/comm/elastic.h"
#include "lockstep/comm/rendezvous.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <ostream>
#include <regex>

#include "testing.h"

namespace lockstep::testing {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// One elastic member, as lockstep run would start it on machine `node`.
std::unique_ptr<Process> member(const LocalStore& store, const std::string& backend, int node, int local,
                                const std::string& machines, int steps, const std::string& run,
                                int local_workers = 1, const std::string& fault = "") {
  return std::make_unique<Process>(
      std::vector<std::string>{helper_path("comm_worker"), "elastic", backend, std::to_string(steps)},
      std::map<std::string, std::string>{{"LOCKSTEP_FAULT_INJECT", fault.empty() ? "<unset>" : fault},
                                         {"LOCKSTEP_ELASTIC", machines},
                                         {"LOCKSTEP_STORE_ADDR", "127.0.0.1:" + std::to_string(store.port())},
                                         {"LOCKSTEP_TOKEN", store.token()},
                                         {"LOCKSTEP_RUN_ID", run},
                                         {"GROUP_RANK", std::to_string(node)},
                                         {"LOCAL_RANK", std::to_string(local)},
                                         {"LOCAL_WORLD_SIZE", std::to_string(local_workers)},
                                         {"LOCKSTEP_PEER_CHECK", "1"},
                                         {"RANK", "<unset>"},
                                         {"WORLD_SIZE", "<unset>"}});
}

// Three members of one job: on shm, three workers of one machine (1:1); elsewhere one worker on
// each of three machines (3:3).
std::vector<std::unique_ptr<Process>> three_members(const LocalStore& store, const std::string& backend, int steps,
                                                    const std::string& run, const std::string& fault = "") {
  const bool one_machine = backend == "shm";
  std::vector<std::unique_ptr<Process>> workers;
  for (int w = 0; w < 3; ++w)
    workers.push_back(member(store, backend, one_machine ? 0 : w, one_machine ? w : 0, one_machine ? "1:1" : "3:3",
                             steps, run, one_machine ? 3 : 1, fault));
  return workers;
}

class ElasticKill : public ::testing::TestWithParam<std::string> {};

// Three members; one is killed mid-run. The other two agree on a membership of two within
// seconds, in the same processes, and finish every step: none is lost, since a step counts only
// once every member's all-reduce of it completed.
TEST_P(ElasticKill, SurvivorsGoOnWithoutTheKilledMemberInTheSameProcesses) {
  const std::string backend = GetParam();
  LocalStore store;
  auto workers = three_members(store, backend, 400, "kill-" + backend);
  for (auto& w : workers) ASSERT_TRUE(w->read_until("step 50 of 3 workers", 60)) << w->output();
  const pid_t survivor_pids[] = {workers[0]->pid(), workers[2]->pid()};
  ASSERT_EQ(::kill(workers[1]->pid(), SIGKILL), 0);
  const auto killed = std::chrono::steady_clock::now();
  for (int w : {0, 2}) {
    auto& p = *workers[static_cast<std::size_t>(w)];
    ASSERT_TRUE(p.read_until("recovered into membership 1: 2 workers, 1 left", 30)) << p.output();
    EXPECT_LT(seconds_since(killed), 3.0) << "detection, agreement and rebuild took too long:\n" << p.output();
  }
  for (int w : {0, 2}) {
    auto& p = *workers[static_cast<std::size_t>(w)];
    EXPECT_EQ(p.wait(60), 0) << p.output();
    EXPECT_NE(p.output().find("done: rank " + std::to_string(w == 0 ? 0 : 1) + " of 2 after 400 steps"),
              std::string::npos)
        << p.output();
    EXPECT_EQ(p.output().find("WRONG"), std::string::npos) << p.output();
  }
  EXPECT_EQ(workers[0]->pid(), survivor_pids[0]);  // the same processes went on
  EXPECT_EQ(workers[2]->pid(), survivor_pids[1]);
}

std::vector<std::string> elastic_backends() {
  std::vector<std::string> b{"shm"};
#ifdef LOCKSTEP_HAVE_GLOO
  b.push_back("gloo");
#endif
  return b;
}
INSTANTIATE_TEST_SUITE_P(Backends, ElasticKill, ::testing::ValuesIn(elastic_backends()));

// A member of the first membership dies before it joins its communicator, or on gloo once it has
// published its pairs' addresses (fault points, so that it is always that moment): the other two,
// waiting for it, notice within seconds (not at the creation's timeout of 300 s, or Gloo's connect
// timeout of five times that), agree on a membership of two and run every step in it.
struct Forming {
  std::string backend, fault;
};
void PrintTo(const Forming& f, std::ostream* os) { *os << f.backend << " with " << f.fault; }
class ElasticLostWhileForming : public ::testing::TestWithParam<Forming> {};

TEST_P(ElasticLostWhileForming, TheOthersLeaveItOutWithinSeconds) {
  const std::string backend = GetParam().backend;
  LocalStore store;
  const auto start = std::chrono::steady_clock::now();
  auto workers = three_members(store, backend, 100, "lost-while-forming-" + backend, GetParam().fault);
  for (int w : {0, 2}) {
    auto& p = *workers[static_cast<std::size_t>(w)];
    ASSERT_TRUE(p.read_until("joined membership 1 as rank " + std::to_string(w / 2) + " of 2", 30)) << p.output();
  }
  EXPECT_LT(seconds_since(start), 20.0) << "the survivors waited for the lost member:\n" << workers[0]->output();
  EXPECT_EQ(workers[1]->wait(30), 128 + SIGKILL) << workers[1]->output();
  for (int w : {0, 2}) {
    auto& p = *workers[static_cast<std::size_t>(w)];
    EXPECT_EQ(p.wait(60), 0) << p.output();
    EXPECT_NE(p.output().find("done: rank " + std::to_string(w / 2) + " of 2 after 100 steps"), std::string::npos)
        << p.output();
    EXPECT_EQ(p.output().find("WRONG"), std::string::npos) << p.output();
  }
}

// Lost before its membership's communicator (on shm and gloo); on gloo also after it published
// its pairs' addresses, while the others connect to it (gloo_connect.h).
std::vector<Forming> forming_cases() {
  std::vector<Forming> cases;
  for (const auto& backend : elastic_backends()) cases.push_back({backend, "kill-before-communicator:0:1"});
#ifdef LOCKSTEP_HAVE_GLOO
  cases.push_back({"gloo", "kill-after-gloo-address:0:1"});
#endif
  return cases;
}
INSTANTIATE_TEST_SUITE_P(Backends, ElasticLostWhileForming, ::testing::ValuesIn(forming_cases()),
                         [](const ::testing::TestParamInfo<Forming>& c) {
                           return c.param.backend +
                                  (c.param.fault.rfind("kill-after-gloo-address", 0) == 0 ? "_AfterItsAddresses" : "");
                         });

// Two members of two machines form the first membership (MIN 2); a third machine's worker starts
// while they run and is admitted at their next check, with the step it was at.
TEST(Elastic, AWorkerThatStartsLaterIsAdmittedAtAStepBoundary) {
  LocalStore store;
  std::vector<std::unique_ptr<Process>> workers;
  for (int node : {0, 1}) workers.push_back(member(store, "gloo", node, 0, "2:3", 300, "grow"));
  for (auto& w : workers) ASSERT_TRUE(w->read_until("step 20 of 2 workers", 60)) << w->output();
  workers.push_back(member(store, "gloo", 2, 0, "2:3", 300, "grow"));
  for (auto& w : workers) ASSERT_TRUE(w->read_until("of 3 workers", 30)) << w->output();
  EXPECT_NE(workers[2]->output().find("joined membership 1 as rank 2 of 3"), std::string::npos)
      << workers[2]->output();
  for (auto& w : workers) {
    EXPECT_EQ(w->wait(60), 0) << w->output();
    EXPECT_NE(w->output().find("of 3 after 300 steps"), std::string::npos) << w->output();
  }
  EXPECT_NE(workers[0]->output().find("grew to membership 1: 3 workers"), std::string::npos) << workers[0]->output();
  // The joiner took up the count where the others were, not from zero.
  std::smatch first;
  const std::string joiner = workers[2]->output();
  ASSERT_TRUE(std::regex_search(joiner, first, std::regex("step (\\d+) of 3 workers")));
  EXPECT_GT(std::stoi(first[1]), 20);
}

// Outside lockstep run --nnodes MIN:MAX the setup says what is missing.
TEST(Elastic, ASetupWithoutTheLaunchersVariablesSaysWhatIsMissing) {
  EXPECT_THROW(comm::elastic_setup_from({}), ConfigError);
  try {
    comm::elastic_setup_from({{"LOCKSTEP_ELASTIC", "2"}, {"LOCKSTEP_STORE_ADDR", "127.0.0.1:1"}});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("MIN:MAX"), std::string::npos) << e.what();
  }
  // A plain rendezvous refuses an elastic worker instead of forming a job of one.
  try {
    comm::rendezvous_info_from({{"LOCKSTEP_ELASTIC", "1:2"}});
    FAIL();
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("join_elastic_from_env"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace lockstep::testing
