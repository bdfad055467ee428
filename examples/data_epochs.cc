// docs/ddp.md's data snippet as a program: each rank walks two epochs of Fashion-MNIST through a
// DistributedSampler and a threaded DataLoader, then the ranks agree on how many real samples
// they saw (each of the 60,000 exactly once per epoch).
//   build/tools/lockstep run --nproc-per-node 2 build/examples/data_epochs
#include <cstdio>

#include "lockstep/base/main.h"
#include "lockstep/comm/rendezvous.h"
#include "lockstep/data/evaluation.h"
#include "lockstep/data/fashion_mnist.h"
#include "lockstep/data/loader.h"
#include "lockstep/data/sampler.h"

using namespace lockstep::data;

int main(int argc, char** argv) {
  return lockstep::run_main(argc, argv, [] {
    auto job = lockstep::comm::join_from_env();
    auto& comm = *job.comm;
    FashionMnist train(FashionMnist::Split::train);  // /usr/share/datasets/fashion-mnist
    DistributedSampler sampler(train.size(), comm.rank(), comm.size(), /*shuffle=*/true, /*seed=*/0);
    for (int epoch = 0; epoch < 2; ++epoch) {
      sampler.set_epoch(epoch);  // a new order every epoch, same on every rank
      DataLoader<ImageBatch> loader(
          sampler.remaining(), [&](const auto& idx) { return train.batch(idx); },
          LoaderOptions{/*batch_size=*/64, /*drop_last=*/false, /*num_workers=*/2});
      EvalTotals seen;
      std::size_t k = 0;
      while (auto batch = loader.next()) {
        for (std::size_t i = 0; i < batch->size(); ++i, ++k)
          if (!sampler.is_padding(k)) seen.count += 1;
      }
      EvalTotals all = allreduce_totals(comm, seen);
      if (comm.rank() == 0)
        std::printf("epoch %d: %zu batches per rank, %lld real samples across %d ranks\n", epoch,
                    loader.num_batches(), static_cast<long long>(all.count), comm.size());
    }
    return 0;
  });
}
