#include "lockstep/data/evaluation.h"

namespace lockstep::data {

EvalTotals allreduce_totals(comm::Communicator& comm, const EvalTotals& local) {
  struct Sums {
    double loss_sum, correct, count, samples;
  } sums{local.loss_sum, static_cast<double>(local.correct), static_cast<double>(local.count),
         static_cast<double>(local.samples)};
  static_assert(sizeof(Sums) == 4 * sizeof(double), "all-reduced as 4 doubles");
  comm.allreduce(&sums, 4, comm::DType::f64, comm::ReduceOp::sum)->wait();
  EvalTotals out;
  out.loss_sum = sums.loss_sum;
  out.correct = static_cast<std::int64_t>(sums.correct);
  out.count = static_cast<std::int64_t>(sums.count);
  out.samples = static_cast<std::int64_t>(sums.samples);
  return out;
}

}  // namespace lockstep::data
