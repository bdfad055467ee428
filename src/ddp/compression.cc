// The codec factory and the auto codec (see ddp/compression.h).
//
// auto, per share: the first start_step calls are exact all-reduces, each timed. At the next
// call the holders measure what each codec's compute costs on this share (a dry run against
// an Across that sends nothing), time one tiny all-reduce (the latency a codec's extra rounds
// pay), average all four figures across machines in one more tiny all-reduce, and every
// holder takes the same decision from the same numbers:
//   link seconds per byte  b = (exact - latency) / bytes an exact all-reduce sends
//   t(codec) = compute + rounds x latency + bytes it sends x b
// The cheapest wins if it saves at least a fifth of the exact time; else the share stays exact.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <sstream>

#include "codecs.h"
#include "lockstep/base/clock.h"
#include "lockstep/error.h"

namespace lockstep {
namespace {

using ddp_detail::allreduce_bytes_sent;

// Stands in for the machines during a dry run: sums nothing, gathers its own bytes everywhere.
class NoMachines final : public comm::Across {
 public:
  explicit NoMachines(int machines) : machines_(machines) {}
  int machines() const override { return machines_; }
  int machine() const override { return 0; }
  void sum(void*, std::size_t, comm::DType) override {}
  void gather(const void* mine, void* all, std::size_t bytes) override {
    for (int m = 0; m < machines_; ++m)
      std::memcpy(static_cast<char*>(all) + std::size_t(m) * bytes, mine, bytes);
  }

 private:
  int machines_;
};

class AutoCodec final : public BucketCodec {
 public:
  AutoCodec(std::vector<BucketTensor> layout, const CompressionOptions& options,
            std::function<void(const std::string&)> log)
      : layout_(std::move(layout)), options_(options), log_(std::move(log)) {}

  void operator()(float* share, std::size_t first, std::size_t count, comm::Across& across) override {
    Share& s = shares_[first];
    ++s.calls;
    if (!s.codec && s.choice.empty()) {
      if (s.calls <= std::max(1, options_.start_step)) {
        const auto begin = Clock::now();
        across.sum(share, count, comm::DType::f32);
        s.exact_seconds.push_back(seconds_since(begin));
        bytes_across_ = std::uint64_t(allreduce_bytes_sent(4.0 * double(count), across.machines()));
        return;
      }
      decide(s, share, first, count, across);
    }
    if (!s.codec) {
      across.sum(share, count, comm::DType::f32);
      bytes_across_ = std::uint64_t(allreduce_bytes_sent(4.0 * double(count), across.machines()));
      return;
    }
    (*s.codec)(share, first, count, across);
    bytes_across_ = s.codec->report().bytes_across;
  }

  CodecReport report() const override {
    CodecReport r{"", "", bytes_across_};
    for (const auto& [first, s] : shares_) {
      r.choice += (r.choice.empty() ? "" : ",") + (s.choice.empty() ? std::string("measuring") : s.choice);
      if (!s.reason.empty()) r.reason += (r.reason.empty() ? "" : "; ") + s.reason;
    }
    return r;
  }

 private:
  struct Share {
    int calls = 0;
    std::vector<double> exact_seconds;
    std::string choice, reason;
    std::shared_ptr<BucketCodec> codec;  // null: exact
  };

  // Compute seconds of `codec` on a copy of the share, its second call (the first builds plans).
  static CodecEstimate dry_run(const std::string& name, BucketCodec& codec, const float* share,
                               std::size_t first, std::size_t count, int machines) {
    std::vector<float> copy(share, share + count);
    NoMachines none(machines);
    codec(copy.data(), first, count, none);
    std::copy(share, share + count, copy.begin());
    const auto begin = Clock::now();
    codec(copy.data(), first, count, none);
    CodecEstimate e;
    e.name = name;
    e.compute = seconds_since(begin);
    e.bytes = double(codec.report().bytes_across);
    return e;
  }

  void decide(Share& s, const float* share, std::size_t first, std::size_t count, comm::Across& across) {
    const int machines = across.machines();
    CompressionOptions now = options_;
    now.start_step = 0;
    auto powersgd = ddp_detail::make_powersgd_codec(layout_, now);
    auto int8 = ddp_detail::make_int8_codec();
    CodecEstimate p = dry_run("powersgd", *powersgd, share, first, count, machines);
    p.rounds = options_.powersgd_rounds;
    CodecEstimate q = dry_run("int8", *int8, share, first, count, machines);

    double tiny = 0;
    const auto ping = Clock::now();
    across.sum(&tiny, 1, comm::DType::f64);
    double figures[4] = {seconds_since(ping), median(s.exact_seconds), p.compute, q.compute};
    across.sum(figures, 4, comm::DType::f64);  // every holder decides from the same numbers
    for (double& f : figures) f /= machines;
    p.compute = figures[2];
    q.compute = figures[3];
    std::vector<CodecEstimate> candidates{q, p};
    const double exact_bytes = allreduce_bytes_sent(4.0 * double(count), machines);
    s.choice = choose_codec(figures[1], exact_bytes, figures[0], candidates);
    // Fresh codecs: the dry runs' state (Q, errors) saw no other machine.
    if (s.choice == "powersgd") s.codec = ddp_detail::make_powersgd_codec(layout_, now);
    if (s.choice == "int8") s.codec = ddp_detail::make_int8_codec();
    s.reason = explain(first, count, figures[1], exact_bytes, figures[0], candidates, s.choice);
    if (log_) log_(s.reason);
  }

  static double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  }

  std::string explain(std::size_t first, std::size_t count, double exact, double exact_bytes, double latency,
                      const std::vector<CodecEstimate>& candidates, const std::string& choice) const {
    std::ostringstream out;
    out.setf(std::ios::fixed);
    out.precision(2);
    const double link = exact > latency ? exact_bytes / (exact - latency) : 0;
    out << "elements [" << first << ", " << first + count << "): exact " << exact * 1e3 << " ms ("
        << exact_bytes / 1e6 << " MB sent, link " << link / 1e6 << " MB/s, latency " << latency * 1e3
        << " ms)";
    for (const auto& e : candidates)
      out << "; " << e.name << (e.name == "powersgd" ? " r" + std::to_string(options_.powersgd_rank) : "")
          << " " << e.seconds * 1e3 << " ms (" << e.compute * 1e3 << " ms compute, " << e.bytes / 1e6
          << " MB)";
    out << " -> " << choice;
    if (choice != "exact")
      out << " (its compute runs on the communication thread, competing with backward for the cores)";
    return out.str();
  }

  std::vector<BucketTensor> layout_;
  CompressionOptions options_;
  std::function<void(const std::string&)> log_;
  std::map<std::size_t, Share> shares_;  // by the share's first element
  std::uint64_t bytes_across_ = 0;
};

}  // namespace

std::string choose_codec(double exact_seconds, double exact_bytes, double latency,
                         std::vector<CodecEstimate>& candidates) {
  const double per_byte = exact_bytes > 0 ? std::max(0.0, exact_seconds - latency) / exact_bytes : 0;
  std::string best = "exact";
  double best_seconds = exact_seconds;
  for (auto& e : candidates) {
    e.seconds = e.compute + e.rounds * latency + e.bytes * per_byte;
    if (e.seconds < best_seconds) {
      best = e.name;
      best_seconds = e.seconds;
    }
  }
  return best_seconds <= 0.8 * exact_seconds ? best : "exact";
}

std::shared_ptr<BucketCodec> make_bucket_codec(const std::string& name, std::vector<BucketTensor> layout,
                                               const CompressionOptions& options,
                                               std::function<void(const std::string&)> log) {
  if (name == "powersgd") return ddp_detail::make_powersgd_codec(std::move(layout), options);
  if (name == "int8") return ddp_detail::make_int8_codec();
  if (name == "auto") return std::make_shared<AutoCodec>(std::move(layout), options, std::move(log));
  throw ConfigError("unknown gradient codec '" + name + "': use powersgd, int8 or auto");
}

comm::Codec as_comm_codec(std::shared_ptr<BucketCodec> codec) {
  return [codec = std::move(codec)](float* share, std::size_t first, std::size_t count,
                                    comm::Across& across) { (*codec)(share, first, count, across); };
}

}  // namespace lockstep
