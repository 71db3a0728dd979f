// The exit status of a process whose async save's background write failed unheard
// (recsave/save/background.py, knob async_failure_exit_code). Python cannot set a process's status
// from its exit handlers but through os._exit, which would skip the rest of the interpreter's
// shutdown (exit handlers registered earlier, multiprocessing's clean-up, the flush of open
// files). A Py_AtExit function runs at the very end of Py_FinalizeEx instead, after all of that:
// it then writes the armed message to stderr and exits with the armed status.
#include "bindings/bind_exit.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace py = pybind11;

namespace {

// Set and cleared with the GIL held (every caller is Python); read once the interpreter is gone.
int g_code = 0;
pid_t g_pid = 0;       // the process that armed it: a forked child inherits the state, not the failure
std::string g_message;
bool g_registered = false;

void exit_if_armed() {
  if (g_code == 0 || g_pid != ::getpid()) return;
  size_t done = 0;
  while (done < g_message.size()) {
    const ssize_t n = ::write(STDERR_FILENO, g_message.data() + done, g_message.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // stderr closed: the status still says it
    done += static_cast<size_t>(n);
  }
  std::fflush(nullptr);
  std::exit(g_code);
}

}  // namespace

void bind_exit(py::module_& m) {
  m.def(
      "arm_exit_status",
      [](int code, const std::string& message) {
        if (code < 1 || code > 255) throw std::invalid_argument("exit status must be in [1, 255], got " + std::to_string(code));
        if (!g_registered) {
          if (Py_AtExit(exit_if_armed) != 0) return false;  // the interpreter's 32 slots are taken
          g_registered = true;
        }
        g_code = code;
        g_pid = ::getpid();
        g_message = message;
        return true;
      },
      py::arg("code"), py::arg("message"),
      "At the end of the interpreter's shutdown, write `message` to stderr and exit with `code` "
      "(1-255) instead of the interpreter's status; False when no exit function can be registered.");
  m.def(
      "disarm_exit_status", [] { g_code = 0; g_message.clear(); },
      "Undo arm_exit_status: the interpreter's own status stands.");
}
