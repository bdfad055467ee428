#include "store/wire.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include "lockstep/error.h"

namespace lockstep::comm::wire {

std::string Writer::frame() const {
  std::string out;
  out.reserve(4 + buf_.size());
  auto n = static_cast<std::uint32_t>(buf_.size());
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(n >> (8 * i)));
  out += buf_;
  return out;
}

std::uint32_t read_length_prefix(const char* p) {
  std::uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= static_cast<std::uint32_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return n;
}

std::uint64_t Reader::le(std::size_t n) {
  if (msg_.size() - pos_ < n) throw Error("malformed message: truncated field");
  std::uint64_t v = 0;
  for (std::size_t i = 0; i < n; ++i)
    v |= static_cast<std::uint64_t>(static_cast<unsigned char>(msg_[pos_ + i])) << (8 * i);
  pos_ += n;
  return v;
}

Type Reader::type() {
  return static_cast<Type>(le(1));
}
std::uint8_t Reader::u8() {
  return static_cast<std::uint8_t>(le(1));
}
std::uint16_t Reader::u16() {
  return static_cast<std::uint16_t>(le(2));
}
std::uint32_t Reader::u32() {
  return static_cast<std::uint32_t>(le(4));
}
std::int64_t Reader::i64() {
  return static_cast<std::int64_t>(le(8));
}

std::string_view Reader::bytes(std::size_t n) {
  if (msg_.size() - pos_ < n) throw Error("malformed message: truncated bytes");
  auto v = msg_.substr(pos_, n);
  pos_ += n;
  return v;
}

std::string Reader::str() {
  return std::string(bytes(u32()));
}

void Reader::expect_end() {
  if (!at_end()) throw Error("malformed message: trailing bytes");
}

Mac handshake_mac(std::string_view token, std::string_view label, std::string_view server_nonce,
                  std::string_view client_nonce, std::string_view bound) {
  std::string data;
  data.reserve(label.size() + server_nonce.size() + client_nonce.size() + bound.size());
  data.append(label).append(server_nonce).append(client_nonce).append(bound);
  Mac mac{};
  unsigned int len = 0;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), mac.data(), &len);
  return mac;
}

bool mac_equal(std::string_view a, const Mac& b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), b.size()) == 0;
}

std::string random_bytes(std::size_t n) {
  std::string out(n, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(out.data()), static_cast<int>(n)) != 1)
    throw SystemError("could not draw random bytes from OpenSSL");
  return out;
}

std::string hex(std::string_view bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * bytes.size());
  for (unsigned char c : bytes) out += {kDigits[c >> 4], kDigits[c & 15]};
  return out;
}

}  // namespace lockstep::comm::wire
