// KV_CHECK(cond, parts...): TORCH_CHECK with a message built without C++ streams.
//
// TORCH_CHECK formats several message parts with an ostringstream instantiated in the calling
// library. On one machine (Ubuntu 24.04, g++ 13.3, torch 2.11) that formatting, compiled into
// kvstore's kernels, crashed the process (SIGSEGV in the stream's number output) where the kernel
// should have raised; torch's own messages, formatted inside its libraries, did not. Here the parts
// are appended to one std::string (integers by std::to_string), which TORCH_CHECK passes on as it
// is, and the kernels hold no stream code of their own. The message is built only when the check
// fails.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace kvcheck {

inline void put(std::string& s, const char* v) { s += v; }
inline void put(std::string& s, const std::string& v) { s += v; }
inline void put(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void put(std::string& s, const c10::Device& v) { s += v.str(); }
inline void put(std::string& s, c10::IntArrayRef v) {  // as torch prints sizes: [2, 3]
  s += '[';
  for (size_t i = 0; i < v.size(); i++) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
inline void put(std::string& s, T v) {
  s += std::to_string(v);
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string s;
  (put(s, parts), ...);
  return s;
}

}  // namespace kvcheck

#define KV_CHECK(cond, ...) TORCH_CHECK(cond, ::kvcheck::message(__VA_ARGS__))
