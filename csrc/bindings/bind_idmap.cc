// Binding of the CPU id map (csrc/core/id_map.h) as recsave._C.IdMap.
//
// Ids arrive as 1-D int64 numpy arrays (anything numpy can cast is accepted and converted) or, for
// zero-copy use from torch, as raw addresses (tensor.data_ptr()). The GIL is released for all
// hashing work. Since released-GIL calls are no longer serialised by Python, each IdMap carries a
// reader/writer lock: lookups share it, mutations hold it alone, so Python threads (say, a
// checkpoint exporting in the background while training inserts) can share one map safely.
// std::invalid_argument / std::length_error from the core surface as recsave.errors.UsageError
// (a ValueError; translated in module.cc).
#include "bindings/bind_idmap.h"

#include <pybind11/numpy.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/id_map.h"

namespace py = pybind11;

namespace {

using I64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

struct PyIdMap {
  explicit PyIdMap(int64_t capacity) : map(capacity) {}
  recsave::IdMap map;
  mutable std::shared_mutex mu;
};

// Runs f(map) with the GIL released, under a shared (read) lock.
template <typename F>
auto reading(const PyIdMap& self, F&& f) {
  py::gil_scoped_release nogil;
  std::shared_lock<std::shared_mutex> lock(self.mu);
  return f(static_cast<const recsave::IdMap&>(self.map));
}

// Runs f(map) with the GIL released, under an exclusive (write) lock.
template <typename F>
auto writing(PyIdMap& self, F&& f) {
  py::gil_scoped_release nogil;
  std::unique_lock<std::shared_mutex> lock(self.mu);
  return f(self.map);
}

std::string shape_of(const py::array& a) {
  std::string s = "(";
  for (py::ssize_t d = 0; d < a.ndim(); ++d) {
    if (d > 0) s += ", ";
    s += std::to_string(a.shape(d));
  }
  return s + (a.ndim() == 1 ? ",)" : ")");
}

int64_t length_1d(const py::array& a, const char* method, const char* arg) {
  if (a.ndim() != 1) {
    throw py::value_error(std::string("IdMap.") + method + ": " + arg +
                          " must be a 1-D int64 array, got shape " + shape_of(a) +
                          " (flatten it first, e.g. ids.reshape(-1))");
  }
  return static_cast<int64_t>(a.shape(0));
}

// A raw address from Python as a typed pointer; 0 means none.
template <typename T>
T* from_address(uint64_t address, const char* method, const char* arg) {
  if (address % alignof(T) != 0) {
    throw py::value_error(std::string("IdMap.") + method + ": " + arg + " = " +
                          std::to_string(address) + " is not aligned to " +
                          std::to_string(alignof(T)) + " bytes");
  }
  return reinterpret_cast<T*>(static_cast<uintptr_t>(address));
}

// A numpy array that takes over a vector's buffer (no copy).
py::array_t<int64_t> to_numpy(std::vector<int64_t>&& v) {
  auto owned = std::make_unique<std::vector<int64_t>>(std::move(v));
  const py::ssize_t n = static_cast<py::ssize_t>(owned->size());
  int64_t* data = owned->data();
  py::capsule owner(owned.get(), [](void* p) { delete static_cast<std::vector<int64_t>*>(p); });
  owned.release();
  return py::array_t<int64_t>(n, data, owner);
}

}  // namespace

void bind_idmap(py::module_& m) {
  py::class_<PyIdMap>(m, "IdMap", R"doc(
CPU map from int64 ids (any value) to dense int64 rows.

New ids take the lowest row released by erase(), else row_capacity (which then grows by one),
in order of first occurrence in a batch; results never depend on `threads`. Thread-safe: lookups
run concurrently, mutations one at a time.)doc")
      .def(py::init<int64_t>(), py::arg("capacity") = 0,
           "An empty map with room for `capacity` ids before it rehashes.")
      .def("__len__", [](const PyIdMap& self) {
        return reading(self, [](const recsave::IdMap& map) { return map.size(); });
      })
      .def("size", [](const PyIdMap& self) {
        return reading(self, [](const recsave::IdMap& map) { return map.size(); });
      }, "Number of ids in the map.")
      .def_property_readonly("row_capacity", [](const PyIdMap& self) {
        return reading(self, [](const recsave::IdMap& map) { return map.row_capacity(); });
      }, "Rows ever handed out (max row + 1); 0 for a new or cleared map. Erase does not lower it.")
      .def_property_readonly("free_rows", [](const PyIdMap& self) {
        return reading(self, [](const recsave::IdMap& map) { return map.free_rows(); });
      }, "Rows released by erase() and not yet reused (row_capacity - len).")
      .def_property_readonly("slot_capacity", [](const PyIdMap& self) {
        return reading(self, [](const recsave::IdMap& map) { return map.capacity(); });
      }, "Hash slots allocated (diagnostics).")
      .def("__repr__", [](const PyIdMap& self) {
        auto sz = reading(self, [](const recsave::IdMap& map) {
          return std::make_pair(map.size(), map.row_capacity());
        });
        return "IdMap(size=" + std::to_string(sz.first) + ", row_capacity=" +
               std::to_string(sz.second) + ")";
      })
      .def("lookup", [](const PyIdMap& self, const I64Array& ids, int threads) {
        const int64_t n = length_1d(ids, "lookup", "ids");
        py::array_t<int64_t> rows(static_cast<py::ssize_t>(n));
        const int64_t* in = ids.data();
        int64_t* out = rows.mutable_data();
        reading(self, [&](const recsave::IdMap& map) { map.lookup(in, n, out, threads); });
        return rows;
      }, py::arg("ids"), py::arg("threads") = 1,
      "Rows of `ids` (int64 array, -1 where absent).")
      .def("lookup_or_insert", [](PyIdMap& self, const I64Array& ids, int threads) {
        const int64_t n = length_1d(ids, "lookup_or_insert", "ids");
        py::array_t<int64_t> rows(static_cast<py::ssize_t>(n));
        py::array_t<bool> is_new(static_cast<py::ssize_t>(n));
        const int64_t* in = ids.data();
        int64_t* out = rows.mutable_data();
        uint8_t* fresh = reinterpret_cast<uint8_t*>(is_new.mutable_data());
        const int64_t num_new = writing(self, [&](recsave::IdMap& map) {
          return map.lookup_or_insert(in, n, out, fresh, threads);
        });
        return py::make_tuple(rows, is_new, num_new);
      }, py::arg("ids"), py::arg("threads") = 1,
      "(rows, is_new, num_new): rows of `ids`, inserting unseen ones; is_new marks the first "
      "occurrence of each inserted id.")
      .def("erase", [](PyIdMap& self, const I64Array& ids) {
        const int64_t n = length_1d(ids, "erase", "ids");
        py::array_t<int64_t> rows(static_cast<py::ssize_t>(n));
        const int64_t* in = ids.data();
        int64_t* out = rows.mutable_data();
        writing(self, [&](recsave::IdMap& map) { return map.erase(in, n, out); });
        return rows;
      }, py::arg("ids"), "Removes `ids`; returns their freed rows (-1 where absent).")
      .def("export", [](const PyIdMap& self, int threads) {
        std::vector<int64_t> ids, rows;
        reading(self, [&](const recsave::IdMap& map) {
          // Sized under the same lock as the copy, so concurrent inserts cannot overrun it.
          ids.resize(static_cast<size_t>(map.size()));
          rows.resize(static_cast<size_t>(map.size()));
          map.export_items(ids.data(), rows.data(), threads);
        });
        return py::make_tuple(to_numpy(std::move(ids)), to_numpy(std::move(rows)));
      }, py::arg("threads") = 1, "(ids, rows) of every entry, sorted by row.")
      .def("load_distinct", [](PyIdMap& self, const I64Array& ids, int threads) {
        const int64_t n = length_1d(ids, "load_distinct", "ids");
        const int64_t* in = ids.data();
        bool ok = false;
        writing(self, [&](recsave::IdMap& map) { ok = map.load_distinct(in, n, threads); });
        return ok;
      }, py::arg("ids"), py::arg("threads") = 1,
      "Restore into an empty map: ids[i] gets row i, inserted by up to `threads` threads (cap it at "
      "the cores you may use). False, leaving the map empty, if an id repeats.")
      .def("insert_with_rows", [](PyIdMap& self, const I64Array& ids, const I64Array& rows,
                                  int threads) {
        const int64_t n = length_1d(ids, "insert_with_rows", "ids");
        const int64_t nr = length_1d(rows, "insert_with_rows", "rows");
        if (nr != n) {
          throw py::value_error("IdMap.insert_with_rows: ids and rows differ in length (" +
                                std::to_string(n) + " vs " + std::to_string(nr) + ")");
        }
        const int64_t* pi = ids.data();
        const int64_t* pr = rows.data();
        writing(self, [&](recsave::IdMap& map) { map.insert_with_rows(pi, pr, n, threads); });
      }, py::arg("ids"), py::arg("rows"), py::arg("threads") = 1,
      "Bulk load (restore): ids new and unique, rows >= 0, unique and unused. UsageError names "
      "the offending id / row and leaves the map unchanged.")
      .def("clear", [](PyIdMap& self) {
        writing(self, [](recsave::IdMap& map) { map.clear(); });
      }, "Removes every id; row_capacity goes back to 0.")
      .def("reserve", [](PyIdMap& self, int64_t n, bool huge_pages) {
        writing(self, [n, huge_pages](recsave::IdMap& map) { map.reserve(n, huge_pages); });
      }, py::arg("n"), py::arg("huge_pages") = true,
      "Makes room for `n` ids without rehashing; a new slot array is advised for huge pages only "
      "with `huge_pages` (else call advise_huge_pages() later).")
      .def("advise_huge_pages", [](PyIdMap& self) {
        writing(self, [](recsave::IdMap& map) { map.advise_huge_pages(); });
      }, "Asks the kernel for huge pages for the slot array (a hint).")
      .def("lookup_ptr", [](const PyIdMap& self, uint64_t ids_ptr, int64_t n, uint64_t rows_ptr,
                            int threads) {
        const int64_t* in = from_address<const int64_t>(ids_ptr, "lookup_ptr", "ids_ptr");
        int64_t* out = from_address<int64_t>(rows_ptr, "lookup_ptr", "rows_ptr");
        reading(self, [&](const recsave::IdMap& map) { map.lookup(in, n, out, threads); });
      }, py::arg("ids_ptr"), py::arg("n"), py::arg("rows_ptr"), py::arg("threads") = 1,
      "lookup() between raw addresses of contiguous int64 buffers (e.g. tensor.data_ptr()).")
      .def("lookup_or_insert_ptr", [](PyIdMap& self, uint64_t ids_ptr, int64_t n,
                                      uint64_t rows_ptr, uint64_t is_new_ptr, int threads) {
        const int64_t* in = from_address<const int64_t>(ids_ptr, "lookup_or_insert_ptr", "ids_ptr");
        int64_t* out = from_address<int64_t>(rows_ptr, "lookup_or_insert_ptr", "rows_ptr");
        uint8_t* fresh = from_address<uint8_t>(is_new_ptr, "lookup_or_insert_ptr", "is_new_ptr");
        return writing(self, [&](recsave::IdMap& map) {
          return map.lookup_or_insert(in, n, out, fresh, threads);
        });
      }, py::arg("ids_ptr"), py::arg("n"), py::arg("rows_ptr"), py::arg("is_new_ptr") = 0,
      py::arg("threads") = 1,
      "lookup_or_insert() between raw addresses (int64 ids and rows, uint8/bool is_new or 0 for "
      "none); returns the number of new ids.");
}
