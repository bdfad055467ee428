// Text files into a token file (`gpt prepare-data`): each file read line by line, each line
// encoded by a tokenizer (SentencePiece's own command-line encoder, spm_encode, works line by
// line too), the tokens written as nanoGPT's flat array (token_files.h), uint16 when the
// vocabulary fits in it, else uint32.
//
// Documents: a file's end closes one, and so does a line equal to the separator when one is given
// ("%" for the fortune files; the line itself is not encoded). Each non-empty document is followed
// by the tokenizer's end-of-document token, so a model trained on the file sees where one ends.
//
// The output appears whole or not at all: it is written to a temporary file beside it and renamed
// over it at the end; an unreadable input or a token outside the vocabulary is a DataError naming
// the file and line, and leaves no file behind.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace lockstep::data {

// A tokenizer as prepare_token_file uses it.
struct TextEncoder {
  std::function<std::vector<std::int64_t>(std::string_view)> encode;
  std::int64_t end_of_document = -1;  // the token written after each document (must be in the vocabulary)
  std::uint64_t vocabulary = 0;       // every token is below it; it picks the file's width
};

struct PreparedText {
  std::uint64_t tokens = 0;     // written, end-of-document tokens included
  std::uint64_t documents = 0;  // non-empty documents
  std::uint64_t lines = 0;      // lines read (separators included)
  int token_bytes = 0;          // 2 (uint16) or 4 (uint32)
};

PreparedText prepare_token_file(const TextEncoder& encoder, const std::vector<std::string>& text_files,
                                const std::string& separator, const std::string& out_path);

}  // namespace lockstep::data
