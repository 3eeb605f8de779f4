// The operators' error messages, built without iostreams.
//
// On the GPU machine a refused call crashed while TORCH_CHECK formatted its message: c10::str
// streams each argument into a std::ostringstream, and inserting an integer segfaulted in
// basic_ostream::_M_insert<long>, inside this library (seen under cuda-gdb). Here numbers go
// through std::to_string and snprintf, and TORCH_CHECK gets one finished string, which
// c10::str passes on untouched. The text reads as c10::str would write it: %g for doubles,
// "[a, b]" for lists.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace bladesmith {
namespace message_detail {

inline void append(std::string& out, const char* text) { out += text; }
inline void append(std::string& out, const std::string& text) { out += text; }
inline void append(std::string& out, const c10::Device& device) { out += device.str(); }
inline void append(std::string& out, c10::ScalarType dtype) { out += c10::toString(dtype); }

inline void append(std::string& out, double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%g", value);
  out += text;
}

template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
void append(std::string& out, T value) {
  out += std::to_string(value);
}

template <typename T>
void append(std::string& out, c10::ArrayRef<T> values) {
  out += '[';
  for (size_t i = 0; i < values.size(); ++i) {
    if (i > 0) out += ", ";
    append(out, values[i]);
  }
  out += ']';
}

}  // namespace message_detail

template <typename... Args>
std::string message(const Args&... args) {
  std::string out;
  (message_detail::append(out, args), ...);
  return out;
}

}  // namespace bladesmith

// TORCH_CHECK, TORCH_CHECK_VALUE and TORCH_CHECK_TYPE with the message built by message().
#define BLADESMITH_CHECK(cond, ...) TORCH_CHECK(cond, ::bladesmith::message(__VA_ARGS__))
#define BLADESMITH_CHECK_VALUE(cond, ...) \
  TORCH_CHECK_VALUE(cond, ::bladesmith::message(__VA_ARGS__))
#define BLADESMITH_CHECK_TYPE(cond, ...) TORCH_CHECK_TYPE(cond, ::bladesmith::message(__VA_ARGS__))
