#include "lockstep/data/evaluation.h"

namespace lockstep::data {

EvalTotals allreduce_totals(comm::Communicator& comm, const EvalTotals& local) {
  double v[3] = {local.loss_sum, static_cast<double>(local.correct), static_cast<double>(local.count)};
  comm.allreduce(v, 3, comm::DType::f64, comm::ReduceOp::sum)->wait();
  EvalTotals out;
  out.loss_sum = v[0];
  out.correct = static_cast<std::int64_t>(v[1]);
  out.count = static_cast<std::int64_t>(v[2]);
  return out;
}

}  // namespace lockstep::data
