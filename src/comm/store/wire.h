// Encoding of the store protocol (docs/store-protocol.md): little-endian integers,
// length-prefixed strings, one message per frame, and the HMAC used by the handshake.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace lockstep::comm::wire {

inline constexpr char kMagic[4] = {'L', 'K', 'S', 'T'};
inline constexpr std::uint16_t kVersion = 2;
inline constexpr std::size_t kNonceBytes = 32;
inline constexpr std::size_t kMacBytes = 32;
// Random per StoreServer object: tells a client that reconnected whether it reached the same
// store (same keys) or a new one on the same address.
inline constexpr std::size_t kInstanceBytes = 16;

enum class Type : std::uint8_t {
  kHello = 0x01,
  kAuth = 0x02,
  kAuthOk = 0x03,
  kSet = 0x10,
  kGet = 0x11,
  kAdd = 0x12,
  kCompareSet = 0x13,
  kWait = 0x14,
  kDelete = 0x15,
  kNumKeys = 0x16,
  kSetEphemeral = 0x17,
  kOk = 0x20,
  kValue = 0x21,
  kInt = 0x22,
  kTimeout = 0x23,
  kError = 0x7F,
};

// Builds one message; frame() prefixes its length.
class Writer {
 public:
  explicit Writer(Type type) { buf_.push_back(static_cast<char>(type)); }
  Writer& u8(std::uint8_t v) { return raw(&v, 1); }
  Writer& u16(std::uint16_t v) { return le(v); }
  Writer& u32(std::uint32_t v) { return le(v); }
  Writer& i64(std::int64_t v) { return le(static_cast<std::uint64_t>(v)); }
  Writer& bytes(std::string_view s) { return raw(s.data(), s.size()); }
  Writer& str(std::string_view s) {
    u32(static_cast<std::uint32_t>(s.size()));
    return bytes(s);
  }
  // The message with its 4-byte length prefix, ready for the socket.
  std::string frame() const;

 private:
  template <typename T>
  Writer& le(T v) {
    for (std::size_t i = 0; i < sizeof(T); ++i) buf_.push_back(static_cast<char>(v >> (8 * i)));
    return *this;
  }
  Writer& raw(const void* p, std::size_t n) {
    buf_.append(static_cast<const char*>(p), n);
    return *this;
  }
  std::string buf_;
};

// Reads one message; every accessor throws lockstep::Error ("malformed message") when the
// message is shorter than the field, so a hostile peer cannot make us read past the end.
class Reader {
 public:
  explicit Reader(std::string_view msg) : msg_(msg) {}
  Type type();
  std::uint8_t u8();
  std::uint16_t u16();
  std::uint32_t u32();
  std::int64_t i64();
  std::string_view bytes(std::size_t n);
  std::string str();
  bool at_end() const { return pos_ == msg_.size(); }
  void expect_end();

 private:
  std::uint64_t le(std::size_t n);
  std::string_view msg_;
  std::size_t pos_ = 0;
};

std::uint32_t read_length_prefix(const char* p);

using Mac = std::array<unsigned char, kMacBytes>;
// HMAC-SHA256(token, label || server_nonce || client_nonce || bound): `bound` is what the MAC
// vouches for besides the nonces (the server's instance id in AUTH_OK).
Mac handshake_mac(std::string_view token, std::string_view label, std::string_view server_nonce,
                  std::string_view client_nonce, std::string_view bound = {});
bool mac_equal(std::string_view a, const Mac& b);  // constant time
std::string random_bytes(std::size_t n);
std::string hex(std::string_view bytes);  // lower-case, two digits a byte

inline constexpr std::string_view kClientLabel = "lockstep-store-client-v2";
inline constexpr std::string_view kServerLabel = "lockstep-store-server-v2";

}  // namespace lockstep::comm::wire
