// pybind11 module recsave._C: the thin layer between the C++ core and the Python package.
// C++ errors become recsave.errors classes; everything else lives in bind_*.cc.
#include <pybind11/pybind11.h>

#include <stdexcept>

#include "bindings/bind_exit.h"
#include "bindings/bind_idmap.h"
#include "bindings/bind_io.h"
#include "bindings/bind_table.h"
#include "core/errors.h"

namespace py = pybind11;

namespace {

void raise_recsave_error(const recsave::Error& e) {
  py::module_ errors = py::module_::import("recsave.errors");
  const char* cls = "UsageError";
  switch (e.kind()) {
    case recsave::ErrorKind::kIo: cls = "StorageError"; break;
    case recsave::ErrorKind::kCorrupt:
    case recsave::ErrorKind::kBounds: cls = "CorruptCheckpointError"; break;
    case recsave::ErrorKind::kInvalid: cls = "UsageError"; break;
  }
  py::dict kwargs;
  kwargs["path"] = e.path().empty() ? py::object(py::none()) : py::object(py::str(e.path()));
  if (e.kind() == recsave::ErrorKind::kIo) {
    kwargs["errno"] = e.error_number() ? py::object(py::int_(e.error_number())) : py::object(py::none());
  }
  py::object exc = errors.attr(cls)(py::str(e.what()), **kwargs);
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

// UsageError is also a ValueError: what pybind11 would have raised for these.
void raise_usage_error(const char* what) {
  py::object exc = py::module_::import("recsave.errors").attr("UsageError")(py::str(what));
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "recsave C++ engine: CRC32C, shard writer / reader, CPU id map, table helpers";
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const recsave::Error& e) {
      raise_recsave_error(e);
    } catch (const std::invalid_argument& e) {  // the id map's argument checks
      raise_usage_error(e.what());
    } catch (const std::length_error& e) {      // an id map past its maximum size
      raise_usage_error(e.what());
    }
  });
  bind_io(m);
  bind_idmap(m);
  bind_table(m);
  bind_exit(m);
}
