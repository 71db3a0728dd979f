// Bindings of the hash-table helpers. Raw addresses (tensor.data_ptr()) keep torch out of the build.
#include "bindings/bind_table.h"

#include "core/counting_sort.h"
#include "core/errors.h"
#include "core/row_copy.h"
#include "core/row_init.h"

namespace py = pybind11;

void bind_table(py::module_& m) {
  m.def("init_rows_normal", [](uint64_t ids, int64_t n, int64_t dim, uint64_t seed, float stddev,
                               uint64_t out, int threads) {
        if (n < 0 || dim < 0) throw recsave::Error(recsave::ErrorKind::kInvalid, "", "negative size");
        if (n == 0 || dim == 0) return;
        py::gil_scoped_release nogil;
        recsave::init_rows_normal(reinterpret_cast<const int64_t*>(ids), n, dim, seed, stddev,
                                  reinterpret_cast<float*>(out), threads);
      }, py::arg("ids_address"), py::arg("n"), py::arg("dim"), py::arg("seed"), py::arg("stddev"),
      py::arg("out_address"), py::arg("threads") = 1,
      "Fills a float32 [n, dim] buffer with normal(0, stddev) values determined by (seed, id, column).");
  m.def("bucket_of", [](uint64_t ids, int64_t n, uint64_t num_buckets, uint64_t out, int threads) {
        if (n < 0) throw recsave::Error(recsave::ErrorKind::kInvalid, "", "negative size");
        if (num_buckets == 0) throw recsave::Error(recsave::ErrorKind::kInvalid, "", "num_buckets must be > 0");
        py::gil_scoped_release nogil;
        recsave::bucket_of(reinterpret_cast<const int64_t*>(ids), n, num_buckets,
                           reinterpret_cast<int64_t*>(out), threads);
      }, py::arg("ids_address"), py::arg("n"), py::arg("num_buckets"), py::arg("out_address"),
      py::arg("threads") = 1, "out[i] = mix64(ids[i]) % num_buckets for int64 buffers.");
  m.def("counting_order", [](uint64_t keys, int64_t n, int64_t num_keys, uint64_t order, uint64_t counts) {
        if (n < 0 || num_keys < 1) {
          throw recsave::Error(recsave::ErrorKind::kInvalid, "", "n must be >= 0 and num_keys >= 1");
        }
        bool ok;
        {
          py::gil_scoped_release nogil;
          ok = recsave::counting_order(reinterpret_cast<const int64_t*>(keys), n, num_keys,
                                       reinterpret_cast<int64_t*>(order), reinterpret_cast<int64_t*>(counts));
        }
        if (!ok) throw recsave::Error(recsave::ErrorKind::kInvalid, "", "a key lies outside [0, num_keys)");
      }, py::arg("keys_address"), py::arg("n"), py::arg("num_keys"), py::arg("order_address"),
      py::arg("counts_address"),
      "Stable counting sort of int64 keys in [0, num_keys): order (n entries) and counts (num_keys).");
  m.def("bucket_order_of_ids", [](uint64_t ids, int64_t n, uint64_t num_buckets, int64_t first, int64_t num_keys,
                                  uint64_t order, uint64_t counts, uint64_t sorted_ids, int threads) {
        if (n < 0 || num_keys < 1 || num_keys > (int64_t{1} << 32) || num_buckets == 0 || first < 0 || threads < 1) {
          throw recsave::Error(recsave::ErrorKind::kInvalid, "",
                               "n must be >= 0, 1 <= num_keys <= 2^32, num_buckets >= 1, first >= 0, threads >= 1");
        }
        bool ok;
        {
          py::gil_scoped_release nogil;
          ok = recsave::bucket_order_of_ids(reinterpret_cast<const int64_t*>(ids), n, num_buckets, first, num_keys,
                                            reinterpret_cast<int64_t*>(order), reinterpret_cast<int64_t*>(counts),
                                            reinterpret_cast<int64_t*>(sorted_ids), threads);
        }
        return ok;
      }, py::arg("ids_address"), py::arg("n"), py::arg("num_buckets"), py::arg("first"), py::arg("num_keys"),
      py::arg("order_address"), py::arg("counts_address"), py::arg("sorted_ids_address"), py::arg("threads") = 1,
      "Stable order of int64 ids by mix64(id) % num_buckets - first, and the count of each of the num_keys "
      "keys, and the ids in that order; False when a key lies outside [0, num_keys).");
  m.def("copy_rows", [](uint64_t dst, uint64_t src, uint64_t num_rows, uint64_t row_bytes, uint64_t rows, int64_t n,
                        int threads) {
        if (n < 0 || threads < 1 || row_bytes == 0 || (n > 0 && (dst == 0 || src == 0 || rows == 0))) {
          throw recsave::Error(recsave::ErrorKind::kInvalid, "",
                               "n must be >= 0, threads >= 1, row_bytes >= 1 and the addresses set");
        }
        bool ok;
        {
          py::gil_scoped_release nogil;
          ok = recsave::copy_rows(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), num_rows,
                                  row_bytes, reinterpret_cast<const int64_t*>(rows), n, threads);
        }
        if (!ok) throw recsave::Error(recsave::ErrorKind::kInvalid, "", "a row lies outside [0, num_rows)");
      }, py::arg("dst_address"), py::arg("src_address"), py::arg("num_rows"), py::arg("row_bytes"),
      py::arg("rows_address"), py::arg("n"), py::arg("threads") = 1,
      "dst row r = src row r for each of the n int64 rows (row-major buffers of num_rows rows of row_bytes).");
  m.def("scatter_rows", [](uint64_t dst, uint64_t num_rows, uint64_t row_bytes, uint64_t rows, int64_t n,
                           uint64_t src) {
        if (n < 0 || row_bytes == 0 || (n > 0 && (dst == 0 || src == 0 || rows == 0))) {
          throw recsave::Error(recsave::ErrorKind::kInvalid, "",
                               "n must be >= 0, row_bytes >= 1 and the addresses set");
        }
        bool ok;
        {
          py::gil_scoped_release nogil;
          ok = recsave::scatter_rows(reinterpret_cast<void*>(dst), num_rows, row_bytes,
                                     reinterpret_cast<const int64_t*>(rows), n, reinterpret_cast<const void*>(src));
        }
        if (!ok) throw recsave::Error(recsave::ErrorKind::kInvalid, "", "a row lies outside [0, num_rows)");
      }, py::arg("dst_address"), py::arg("num_rows"), py::arg("row_bytes"), py::arg("rows_address"), py::arg("n"),
      py::arg("src_address"),
      "dst row rows[i] = src row i for the n int64 rows, in order (a repeated row takes its last value).");
  m.def("mix64", [](int64_t id) { return static_cast<int64_t>(recsave::mix64(static_cast<uint64_t>(id))); },
        py::arg("id"), "splitmix64 finaliser of one id, as a signed int64.");
}
