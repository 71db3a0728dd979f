// Error type of the C++ core. Carries a category so the binding can map it onto the matching
// Python class of recsave.errors, plus the file and the reason in the message.
#pragma once

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace recsave {

enum class ErrorKind {
  kIo,        // an operating-system call failed (errno is set)
  kCorrupt,   // the bytes on disk are not what the index promises (checksum, truncation)
  kBounds,    // an offset / length points outside the file or overflows
  kInvalid,   // the caller passed something unusable
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& path, const std::string& reason, int err = 0)
      : std::runtime_error(path.empty() ? reason : path + ": " + reason),
        kind_(kind), path_(path), errno_(err) {}

  ErrorKind kind() const { return kind_; }
  const std::string& path() const { return path_; }
  int error_number() const { return errno_; }

 private:
  ErrorKind kind_;
  std::string path_;
  int errno_;
};

// Throws kIo with strerror(errno) for an OS call `what` on `path`.
[[noreturn]] inline void throw_errno(const std::string& path, const std::string& what) {
  int err = errno;
  throw Error(ErrorKind::kIo, path, what + " failed: " + std::strerror(err), err);
}

}  // namespace recsave
