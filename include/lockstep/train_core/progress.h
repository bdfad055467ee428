// Rank 0's progress output: a bar for terminals, a plain line otherwise. Torch-free.
#pragma once

#include <cstdint>
#include <string>

namespace lockstep::train {

std::string format_duration(double seconds);  // "01:23" or "1:02:03"
// "3812 samples/s", or for per-token tasks (tokens_per_second > 0) "5603 tokens/s"
std::string rate_text(double samples_per_second, double tokens_per_second);
// "\r 42% |##########              | 420/1000 [00:10<00:14, 3812 samples/s, loss 0.4321]"
std::string progress_bar(std::int64_t step, std::int64_t max_steps, double elapsed, double eta,
                         const std::string& rate, double loss);
// "step 100/1000 (epoch 0.21): loss 0.5432, lr 0.00199, 3812 samples/s, exposed comm 4.1%, ETA 01:23"
std::string progress_line(std::int64_t step, std::int64_t max_steps, double epoch, double loss, double lr,
                          const std::string& rate, double exposed_fraction, double eta);

}  // namespace lockstep::train
