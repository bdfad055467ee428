// DataLoader: batches assembled on background threads, handed out in a fixed order.
//
// The index list (usually a DistributedSampler's) is cut into batches up front, so batch b holds
// the same indices whatever the thread count. With num_workers == 0 next() builds each batch on
// the caller's thread; otherwise num_workers threads claim batch numbers in order and build up to
// `prefetch` batches ahead of the consumer (a bounded queue: memory stays bounded when training
// is slower than loading). next() returns batch b only after batches 0..b-1, and rethrows in the
// caller an exception that building batch b threw. Destroying the loader mid-epoch stops and
// joins the threads (batches being built are finished, not interrupted).
//
// Threading: workers call `collate` concurrently, so it must be safe to call from several
// threads (reading an immutable dataset is). next() is for one consumer thread.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace lockstep::data {

struct LoaderOptions {
  std::size_t batch_size = 64;
  bool drop_last = false;    // drop a last batch smaller than batch_size
  int num_workers = 0;       // background threads; 0 builds batches in next()
  std::size_t prefetch = 0;  // batches built ahead of the consumer; 0 means 2 per worker
};

template <typename Batch>
class DataLoader {
 public:
  using Collate = std::function<Batch(const std::vector<std::size_t>& indices)>;

  DataLoader(const std::vector<std::size_t>& indices, Collate collate, LoaderOptions options)
      : collate_(std::move(collate)), options_(options) {
    std::size_t bs = std::max<std::size_t>(options_.batch_size, 1);
    for (std::size_t start = 0; start < indices.size(); start += bs) {
      std::size_t end = std::min(indices.size(), start + bs);
      if (options_.drop_last && end - start < bs) break;
      batches_.emplace_back(indices.begin() + static_cast<std::ptrdiff_t>(start),
                            indices.begin() + static_cast<std::ptrdiff_t>(end));
    }
    if (options_.prefetch == 0)
      options_.prefetch = 2 * static_cast<std::size_t>(std::max(options_.num_workers, 1));
    for (int w = 0; w < options_.num_workers; ++w) threads_.emplace_back([this] { work(); });
  }

  ~DataLoader() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  std::size_t num_batches() const { return batches_.size(); }

  // The next batch, or nullopt after the last.
  std::optional<Batch> next() {
    if (consumed_ >= batches_.size()) return std::nullopt;
    if (threads_.empty()) return collate_(batches_[consumed_++]);
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return ready_.count(consumed_) != 0; });
    Result r = std::move(ready_.at(consumed_));
    ready_.erase(consumed_);
    ++consumed_;
    lock.unlock();
    cv_.notify_all();  // a worker may now build further ahead
    if (r.error) std::rethrow_exception(r.error);
    return std::move(r.batch);
  }

 private:
  struct Result {
    std::optional<Batch> batch;
    std::exception_ptr error;
  };

  void work() {
    for (;;) {
      std::size_t b;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] {
          return stopping_ || claimed_ >= batches_.size() || claimed_ < consumed_ + options_.prefetch;
        });
        if (stopping_ || claimed_ >= batches_.size()) return;
        b = claimed_++;
      }
      Result r;
      try {
        r.batch = collate_(batches_[b]);
      } catch (...) {
        r.error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        ready_.emplace(b, std::move(r));
      }
      cv_.notify_all();
    }
  }

  Collate collate_;
  LoaderOptions options_;
  std::vector<std::vector<std::size_t>> batches_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::size_t, Result> ready_;
  std::size_t claimed_ = 0;   // next batch number a worker will build
  std::size_t consumed_ = 0;  // batches handed to the consumer
  bool stopping_ = false;
  std::vector<std::thread> threads_;
};

}  // namespace lockstep::data
