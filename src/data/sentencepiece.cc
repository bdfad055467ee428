// SentencePiece models through libsentencepiece: see sentencepiece.h.
#include "lockstep/data/sentencepiece.h"

#include "lockstep/error.h"

#if defined(LOCKSTEP_HAVE_SENTENCEPIECE) && !defined(LOCKSTEP_SENTENCEPIECE_BESIDE_DEBIAN_TORCH)
#define LOCKSTEP_READS_SENTENCEPIECE 1
#include <sentencepiece_processor.h>
#endif

namespace lockstep::data {

#ifdef LOCKSTEP_READS_SENTENCEPIECE

struct SentencePiece::Processor {
  sentencepiece::SentencePieceProcessor sp;
};

bool sentencepiece_built() {
  return true;
}

SentencePiece::SentencePiece(const std::string& model_file)
    : processor_(std::make_unique<Processor>()), model_file_(model_file) {
  const auto status = processor_->sp.Load(model_file);
  if (!status.ok())
    throw DataError(model_file + ": not a SentencePiece model that can be read (" + status.ToString() +
                    "); pass the .model file spm_train or sentencepiece.SentencePieceTrainer wrote");
}

std::vector<std::int64_t> SentencePiece::encode(std::string_view text) const {
  std::vector<int> ids;
  const auto status = processor_->sp.Encode(text, &ids);
  if (!status.ok()) throw DataError(model_file_ + ": cannot encode text (" + status.ToString() + ")");
  return {ids.begin(), ids.end()};
}

std::string SentencePiece::decode(const std::vector<std::int64_t>& ids) const {
  std::vector<int> pieces;
  pieces.reserve(ids.size());
  for (std::int64_t id : ids) {
    if (id < 0 || static_cast<std::uint64_t>(id) >= vocabulary())
      throw DataError("token " + std::to_string(id) + " is outside " + model_file_ + "'s vocabulary of " +
                      std::to_string(vocabulary()));
    pieces.push_back(static_cast<int>(id));
  }
  std::string text;
  const auto status = processor_->sp.Decode(pieces, &text);
  if (!status.ok()) throw DataError(model_file_ + ": cannot decode tokens (" + status.ToString() + ")");
  return text;
}

std::uint64_t SentencePiece::vocabulary() const {
  return static_cast<std::uint64_t>(processor_->sp.GetPieceSize());
}

std::int64_t SentencePiece::end_of_sentence() const {
  return processor_->sp.eos_id();
}

#else  // without libsentencepiece: not found, or beside Debian's libtorch

struct SentencePiece::Processor {};

bool sentencepiece_built() {
  return false;
}

SentencePiece::SentencePiece(const std::string& model_file) : model_file_(model_file) {
#ifdef LOCKSTEP_SENTENCEPIECE_BESIDE_DEBIAN_TORCH
  // Debian's libsentencepiece carries its own protobuf-lite, whose exported symbols the libprotobuf
  // that Debian's libtorch loads binds to: the program would die at start (src/data/CMakeLists.txt).
  throw ConfigError("this program runs on Debian's libtorch 1.13, which cannot share a process with "
                    "libsentencepiece (their protobuf copies collide), so it cannot read " + model_file +
                    ": use a build on PyTorch 2.x (LOCKSTEP_TORCH=pip, docs/building.md)");
#else
  throw ConfigError("this lockstep was built without SentencePiece, so it cannot read " + model_file +
                    ": install it (apt-get install libsentencepiece-dev) and build again");
#endif
}

std::vector<std::int64_t> SentencePiece::encode(std::string_view) const {
  return {};
}
std::string SentencePiece::decode(const std::vector<std::int64_t>&) const {
  return {};
}
std::uint64_t SentencePiece::vocabulary() const {
  return 0;
}
std::int64_t SentencePiece::end_of_sentence() const {
  return -1;
}

#endif

SentencePiece::~SentencePiece() = default;

TextEncoder SentencePiece::encoder() const {
  return {[this](std::string_view text) { return encode(text); }, end_of_sentence(), vocabulary()};
}

}  // namespace lockstep::data
