// The job's layout (pipe_core/layout.h): every group derived from it partitions the world, the
// numbering is the one documented, and each request it cannot lay out is refused with a message
// that names the problem.
#include "lockstep/pipe_core/layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>

#include "lockstep/error.h"
#include "testing.h"

namespace lockstep {
namespace {

LayoutRequest request(int world, int pipeline, int tensor, int zero = 0) {
  LayoutRequest r;
  r.world = world;
  r.pipeline_parallel = pipeline;
  r.tensor_parallel = tensor;
  r.zero_stage = zero;
  return r;
}

template <typename F>
std::string config_error_of(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// Every group along `dim` has `size` ranks, and each rank is in exactly one, the one group_of gives.
void expect_partition(const Layout& l, ParallelDim dim, int size) {
  std::multiset<int> covered;
  for (const auto& g : l.groups(dim)) {
    EXPECT_EQ(static_cast<int>(g.size()), size) << dim_name(dim);
    EXPECT_TRUE(std::is_sorted(g.begin(), g.end()));
    for (const int r : g) {
      covered.insert(r);
      EXPECT_EQ(l.group_of(dim, r), g) << dim_name(dim) << " rank " << r;
      EXPECT_EQ(l.group_name(dim, r), l.group_name(dim, g.front()));
    }
  }
  EXPECT_EQ(static_cast<int>(covered.size()), l.world());
  for (int r = 0; r < l.world(); ++r) EXPECT_EQ(covered.count(r), 1u) << dim_name(dim) << " rank " << r;
}

// The properties every layout has, whatever its sizes.
void expect_consistent(const Layout& l) {
  expect_partition(l, ParallelDim::tensor, l.tensor());
  expect_partition(l, ParallelDim::data, l.data());
  expect_partition(l, ParallelDim::pipeline, l.pipeline());
  expect_partition(l, ParallelDim::model, l.pipeline() * l.tensor());
  expect_partition(l, ParallelDim::mesh, l.pipeline() * l.data());
  std::set<std::string> names;
  for (int r = 0; r < l.world(); ++r) {
    const auto c = l.coordinates_of(r);
    EXPECT_EQ(l.rank_at(c), r);
    EXPECT_EQ(r, (c.pipeline * l.data() + c.data) * l.tensor() + c.tensor);  // the documented numbering
    const auto tensor = l.group_of(ParallelDim::tensor, r);
    EXPECT_EQ(tensor.back() - tensor.front(), l.tensor() - 1) << "a tensor group is neighbours";
    for (const auto dim :
         {ParallelDim::tensor, ParallelDim::data, ParallelDim::pipeline, ParallelDim::model, ParallelDim::mesh})
      names.insert(l.group_name(dim, r));
  }
  // Names differ between groups: one name per group, over all five.
  EXPECT_EQ(names.size(), l.groups(ParallelDim::tensor).size() + l.groups(ParallelDim::data).size() +
                              l.groups(ParallelDim::pipeline).size() + l.groups(ParallelDim::model).size() +
                              l.groups(ParallelDim::mesh).size());
}

TEST(Layout, RandomLayoutsPartitionTheWorldAlongEveryDimension) {
  std::mt19937_64 rng(testing::test_seed());
  for (int trial = 0; trial < 200; ++trial) {
    const int p = 1 + static_cast<int>(rng() % 4), d = 1 + static_cast<int>(rng() % 4),
              t = 1 + static_cast<int>(rng() % 4);
    SCOPED_TRACE("P " + std::to_string(p) + " D " + std::to_string(d) + " T " + std::to_string(t));
    const Layout l = Layout::build(request(p * d * t, p, t));
    EXPECT_EQ(l.pipeline(), p);
    EXPECT_EQ(l.data(), d);
    EXPECT_EQ(l.tensor(), t);
    expect_consistent(l);
  }
}

TEST(Layout, WithoutATensorDimensionItIsThePipelineMesh) {
  const Layout l = Layout::build(request(6, 2, 1));
  const pipe_core::PipelineMesh mesh = l.pipeline_mesh();
  for (int r = 0; r < 6; ++r) {
    EXPECT_EQ(l.group_of(ParallelDim::data, r), mesh.stage_group(mesh.pipeline_rank_of(r)));
    EXPECT_EQ(l.group_of(ParallelDim::pipeline, r), mesh.pipeline_group(mesh.replica_of(r)));
    EXPECT_EQ(l.data_rank_of(r), mesh.replica_of(r));
  }
}

// Each tensor rank's mesh group is a P x D pipeline mesh: its rank p * D + d is the world rank at
// (p, d, t), so the mesh's stage and pipeline groups are the layout's data and pipeline groups.
TEST(Layout, EachTensorRanksMeshIsThePipelineMeshOfItsRanks) {
  const Layout l = Layout::build(request(12, 2, 2));  // 2 pipeline x 3 data x 2 tensor
  const pipe_core::PipelineMesh mesh = l.pipeline_mesh();
  EXPECT_EQ(mesh.pipeline, 2);
  EXPECT_EQ(mesh.replicas, 3);
  for (int r = 0; r < l.world(); ++r) {
    const auto group = l.group_of(ParallelDim::mesh, r);
    ASSERT_EQ(static_cast<int>(group.size()), 6);
    const auto c = l.coordinates_of(r);
    const int in_mesh = static_cast<int>(std::find(group.begin(), group.end(), r) - group.begin());
    EXPECT_EQ(in_mesh, c.pipeline * l.data() + c.data);
    auto to_world = [&](const std::vector<int>& ranks) {
      std::vector<int> out;
      for (const int m : ranks) out.push_back(group[static_cast<std::size_t>(m)]);
      return out;
    };
    EXPECT_EQ(to_world(mesh.stage_group(mesh.pipeline_rank_of(in_mesh))), l.group_of(ParallelDim::data, r));
    EXPECT_EQ(to_world(mesh.pipeline_group(mesh.replica_of(in_mesh))), l.group_of(ParallelDim::pipeline, r));
  }
}

TEST(Layout, SaysWhatItIs) {
  EXPECT_EQ(Layout().describe(), "1 worker");
  LayoutRequest r = request(8, 2, 2, 1);
  r.sequence_parallel = true;
  r.machine_of = {0, 0, 0, 0, 1, 1, 1, 1};
  EXPECT_EQ(Layout::build(r).describe(),
            "8 workers on 2 machines: 2 pipeline x 2 data (ZeRO-1) x 2 tensor (sequence parallel)");
  EXPECT_EQ(Layout::build(request(4, 1, 4)).describe(), "4 workers: 4 tensor");
}

TEST(Layout, ATensorGroupAcrossMachinesIsRefusedNamingThem) {
  LayoutRequest r = request(6, 1, 2);
  r.machine_of = {0, 0, 0, 1, 1, 1};  // ranks 2 and 3 would span machines 0 and 1
  const std::string e = config_error_of([&] { Layout::build(r); });
  EXPECT_NE(e.find("ranks 2,3 spans machines 0 and 1"), std::string::npos) << e;
  r.tensor_parallel = 3;
  EXPECT_EQ(Layout::build(r).machines(), 2);
}

TEST(Layout, DataGroupsWithinMachinesIsAPropertyOfTheMachines) {
  LayoutRequest r = request(8, 2, 1, 3);
  r.machine_of = {0, 0, 0, 0, 1, 1, 1, 1};  // each pipeline rank's 4 replicas on one machine
  EXPECT_TRUE(Layout::build(r).data_groups_within_machines());
  r.pipeline_parallel = 1;  // now the 8 replicas span both
  EXPECT_FALSE(Layout::build(r).data_groups_within_machines());
  EXPECT_FALSE(Layout::build(request(4, 1, 1)).data_groups_within_machines()) << "unknown machines";
}

TEST(Layout, RequestsItCannotLayOutAreRefusedWithWhatWouldWork) {
  const std::string product = config_error_of([] { Layout::build(request(6, 2, 2)); });
  EXPECT_NE(product.find("does not divide the 6 workers"), std::string::npos) << product;
  EXPECT_NE(product.find("--tensor-parallel may be 1, 3"), std::string::npos) << product;
  EXPECT_NE(config_error_of([] { Layout::build(request(4, 0, 1)); }).find("--pipeline-parallel must be at least 1"),
            std::string::npos);
  EXPECT_NE(config_error_of([] { Layout::build(request(4, 1, 0)); }).find("--tensor-parallel must be at least 1"),
            std::string::npos);
  EXPECT_NE(config_error_of([] { Layout::build(request(4, 1, 1, 4)); }).find("--zero-stage"), std::string::npos);
  LayoutRequest sp = request(4, 1, 1);
  sp.sequence_parallel = true;
  EXPECT_NE(config_error_of([&] { Layout::build(sp); }).find("needs --tensor-parallel"), std::string::npos);
  LayoutRequest cp = request(4, 1, 1);
  cp.context_parallel = 2;
  EXPECT_NE(config_error_of([&] { Layout::build(cp); }).find("not built"), std::string::npos);
  LayoutRequest short_machines = request(4, 1, 2);
  short_machines.machine_of = {0, 0};
  EXPECT_NE(config_error_of([&] { Layout::build(short_machines); }), "");
  EXPECT_NE(config_error_of([] { Layout::build(request(4, 1, 2)).coordinates_of(4); }), "");
}

}  // namespace
}  // namespace lockstep
