// One DDP step on a linear layer: the gradient DDP leaves must be the mean of every rank's own
// gradient, which each rank also computes by hand (its own backward, then an all-reduce).
#include <torch/nn/modules/linear.h>
#include <torch/nn/functional/loss.h>

#include <cstdio>

#include "lockstep/base/main.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/ddp/ddp.h"

int main(int argc, char** argv) {
  return lockstep::run_main(argc, argv, [] {
    auto job = lockstep::comm::join_from_env();
    auto& comm = *job.comm;
    torch::manual_seed(7);
    auto model = std::make_shared<torch::nn::LinearImpl>(4, 2);
    auto copy = std::make_shared<torch::nn::LinearImpl>(4, 2);
    torch::manual_seed(100 + comm.rank());  // different data on every rank
    auto x = torch::randn({8, 4}), y = torch::randn({8, 2});

    lockstep::DistributedDataParallel ddp(model, comm);  // rank 0's weights everywhere
    {
      torch::NoGradGuard no_grad;
      copy->weight.copy_(model->weight);
      copy->bias.copy_(model->bias);
    }
    torch::nn::functional::mse_loss(ddp.forward(x), y).backward();

    torch::nn::functional::mse_loss(copy->forward(x), y).backward();
    auto expected = copy->weight.grad().contiguous();
    comm.allreduce(expected.data_ptr<float>(), static_cast<std::size_t>(expected.numel()), lockstep::comm::DType::f32,
                   lockstep::comm::ReduceOp::avg)
        ->wait();
    const double error = (model->weight.grad() - expected).abs().max().item<double>();
    if (error > 1e-6) {
      std::printf("ddp WRONG on rank %d: gradient off by %g\n", comm.rank(), error);
      return 1;
    }
    std::printf("ddp ok rank %d of %d\n", comm.rank(), comm.size());
    return 0;
  });
}
