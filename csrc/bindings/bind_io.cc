// Bindings of CRC32C and the shard writer / reader. Buffers arrive either as Python buffer objects
// (numpy arrays, bytes, memoryview) or as arrays of raw addresses (tensor.data_ptr()); the GIL is
// released for all I/O and hashing.
#include "bindings/bind_io.h"

#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <vector>

#include "core/crc32c.h"
#include "core/errors.h"
#include "core/segment_rule.h"
#include "core/shard_io.h"

namespace py = pybind11;
using recsave::ErrorKind;

namespace {

using U64Array = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>;
using U32Array = py::array_t<uint32_t, py::array::c_style | py::array::forcecast>;

void require_1d(const py::array& a, const char* name, py::ssize_t n) {
  if (a.ndim() != 1 || (n >= 0 && a.shape(0) != n)) {
    throw recsave::Error(ErrorKind::kInvalid, "",
                         std::string(name) + " must be a 1-D array with one entry per item");
  }
}

using CrcFn = uint32_t (*)(uint32_t, const void*, size_t);

uint32_t crc_of_buffer(const py::buffer& data, uint32_t crc, CrcFn fn) {
  py::buffer_info info = data.request();
  if (!PyBuffer_IsContiguous(info.view(), 'C')) {
    throw recsave::Error(ErrorKind::kInvalid, "", "crc32c needs a C-contiguous buffer");
  }
  const void* ptr = info.ptr;
  size_t n = static_cast<size_t>(info.size * info.itemsize);
  py::gil_scoped_release nogil;
  return fn(crc, ptr, n);
}

std::vector<recsave::WriteItem> write_items(const U64Array& offsets, const U64Array& addresses,
                                            const U64Array& lengths) {
  require_1d(offsets, "offsets", -1);
  py::ssize_t n = offsets.shape(0);
  require_1d(addresses, "addresses", n);
  require_1d(lengths, "lengths", n);
  std::vector<recsave::WriteItem> items(n);
  auto o = offsets.unchecked<1>();
  auto a = addresses.unchecked<1>();
  auto l = lengths.unchecked<1>();
  for (py::ssize_t i = 0; i < n; ++i) {
    items[i] = {o(i), reinterpret_cast<const void*>(static_cast<uintptr_t>(a(i))), l(i)};
  }
  return items;
}

}  // namespace

void bind_io(py::module_& m) {
  m.def("crc32c", [](const py::buffer& data, uint32_t crc) { return crc_of_buffer(data, crc, recsave::crc32c); },
        py::arg("data"), py::arg("crc") = 0,
        "CRC32C of a contiguous buffer, extending `crc` (the CRC of the preceding bytes).");
  m.def("crc32c_portable",
        [](const py::buffer& data, uint32_t crc) { return crc_of_buffer(data, crc, recsave::crc32c_portable); },
        py::arg("data"), py::arg("crc") = 0, "CRC32C through the portable table path.");
  m.def("crc32c_hardware", [](const py::buffer& data, uint32_t crc) {
        if (!recsave::crc32c_hardware_available()) {
          throw recsave::Error(ErrorKind::kInvalid, "", "this CPU has no SSE4.2 crc32 instruction");
        }
        return crc_of_buffer(data, crc, recsave::crc32c_hardware);
      }, py::arg("data"), py::arg("crc") = 0,
      "CRC32C through the fastest x86-64 kernel the CPU has ('vpclmul', 'pclmul', else 'sse4.2').");
  m.def("crc32c_combine", &recsave::crc32c_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"),
        "CRC32C of A followed by B from crc32c(A), crc32c(B) and len(B).");
  const auto kernel_name = [] { return recsave::crc32c_kernel_name(recsave::crc32c_selected_kernel()); };
  m.def("crc32c_kernel", kernel_name, "The kernel crc32c() uses: 'vpclmul', 'pclmul', 'sse4.2' or 'portable'.");
  m.def("crc32c_implementation", kernel_name,
        "Alias of crc32c_kernel(), kept for compatibility (it said 'sse4.2' for the pclmul kernel).");
  m.def("crc32c_address", [](uint64_t address, uint64_t length, uint32_t crc) {
        py::gil_scoped_release nogil;
        return recsave::crc32c(crc, reinterpret_cast<const void*>(static_cast<uintptr_t>(address)), length);
      }, py::arg("address"), py::arg("length"), py::arg("crc") = 0,
      "CRC32C of `length` bytes at a raw address (e.g. tensor.data_ptr()).");
  m.def("crc32c_hardware_available", &recsave::crc32c_hardware_available);
  using Int64s = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
  m.def("bucket_segment_ends", [](const Int64s& row_starts, int64_t row_bytes, int64_t step, int64_t min_bytes) {
        const int64_t n = static_cast<int64_t>(row_starts.size());
        const int64_t count = recsave::bucket_segment_ends(row_starts.data(), n, row_bytes, step, min_bytes, nullptr);
        py::array_t<int64_t> ends(count);
        recsave::bucket_segment_ends(row_starts.data(), n, row_bytes, step, min_bytes, ends.mutable_data());
        return ends;
      }, py::arg("row_starts"), py::arg("row_bytes"), py::arg("step"), py::arg("min_bytes"),
      "The checksum segment ends (int64 array) of the bucket rule (docs/FORMAT.md section 3).");
  m.def("bucket_segment_count", [](const Int64s& row_starts, int64_t row_bytes, int64_t step, int64_t min_bytes) {
        return recsave::bucket_segment_ends(row_starts.data(), static_cast<int64_t>(row_starts.size()), row_bytes,
                                            step, min_bytes, nullptr);
      }, py::arg("row_starts"), py::arg("row_bytes"), py::arg("step"), py::arg("min_bytes"),
      "How many segments bucket_segment_ends gives, without listing them.");
  m.def("fsync_directory", [](const std::string& dir) {
    py::gil_scoped_release nogil;
    recsave::fsync_directory(dir);
  }, py::arg("path"));

  py::class_<recsave::ShardWriter>(m, "ShardWriter",
      "Writes one shard file under a temporary name; commit() renames it into place.")
      .def(py::init<std::string, bool>(), py::arg("path"), py::arg("durable") = true)
      .def_property_readonly("path", &recsave::ShardWriter::path)
      .def_property_readonly("temp_path", &recsave::ShardWriter::temp_path)
      .def_property_readonly("bytes_written", &recsave::ShardWriter::bytes_written)
      .def("reserve", [](recsave::ShardWriter& w, uint64_t size) {
        py::gil_scoped_release nogil;
        w.reserve(size);
      }, py::arg("size"))
      .def("write", [](recsave::ShardWriter& w, const U64Array& offsets, const U64Array& addresses,
                       const U64Array& lengths, int threads) {
        std::vector<recsave::WriteItem> items = write_items(offsets, addresses, lengths);
        py::array_t<uint32_t> crcs(static_cast<py::ssize_t>(items.size()));
        uint32_t* out = crcs.mutable_data();
        {
          py::gil_scoped_release nogil;
          w.write(items.data(), items.size(), out, threads);
        }
        return crcs;
      }, py::arg("offsets"), py::arg("addresses"), py::arg("lengths"), py::arg("threads") = 1,
      "Writes len(offsets) items (raw source addresses) at their offsets; returns their CRC32Cs.")
      .def("write_gathered", [](recsave::ShardWriter& w, const U64Array& offsets, const U64Array& bases,
                                const U64Array& base_rows, const U64Array& row_bytes,
                                const U64Array& rows_addresses, const U64Array& num_rows, int threads) {
        require_1d(offsets, "offsets", -1);
        py::ssize_t n = offsets.shape(0);
        for (const auto* a : {&bases, &base_rows, &row_bytes, &rows_addresses, &num_rows}) require_1d(*a, "gather arrays", n);
        std::vector<recsave::GatherItem> items(n);
        for (py::ssize_t i = 0; i < n; ++i) {
          items[i] = {offsets.at(i), reinterpret_cast<const void*>(static_cast<uintptr_t>(bases.at(i))),
                      base_rows.at(i), row_bytes.at(i),
                      reinterpret_cast<const int64_t*>(static_cast<uintptr_t>(rows_addresses.at(i))), num_rows.at(i)};
        }
        py::array_t<uint32_t> crcs(n);
        uint32_t* out = crcs.mutable_data();
        {
          py::gil_scoped_release nogil;
          w.write_gathered(items.data(), items.size(), out, threads);
        }
        return crcs;
      }, py::arg("offsets"), py::arg("bases"), py::arg("base_rows"), py::arg("row_bytes"),
      py::arg("rows_addresses"), py::arg("num_rows"), py::arg("threads") = 1,
      "Writes item i = the num_rows[i] rows (int64 indexes at rows_addresses[i]) of the row-major matrix "
      "at bases[i] (base_rows[i] rows of row_bytes[i] bytes) back to back at offsets[i]; returns their CRC32Cs.")
      .def("write_bytes", [](recsave::ShardWriter& w, uint64_t offset, const py::buffer& data) {
        py::buffer_info info = data.request();
        recsave::WriteItem item{offset, info.ptr, static_cast<uint64_t>(info.size * info.itemsize)};
        uint32_t crc = 0;
        {
          py::gil_scoped_release nogil;
          w.write(&item, 1, &crc, 1);
        }
        return crc;
      }, py::arg("offset"), py::arg("data"), "Writes one buffer at `offset`; returns its CRC32C.")
      .def("commit", [](recsave::ShardWriter& w) {
        py::gil_scoped_release nogil;
        w.commit();
      })
      .def("abort", &recsave::ShardWriter::abort);

  py::class_<recsave::ShardReader>(m, "ShardReader",
      "Ranged, checksum-verified reads from one shard file.")
      .def(py::init([](std::string path) {
        py::gil_scoped_release nogil;
        return std::make_unique<recsave::ShardReader>(std::move(path));
      }), py::arg("path"))
      .def_property_readonly("size", &recsave::ShardReader::size)
      .def_property_readonly("path", &recsave::ShardReader::path)
      .def("read_header", [](const recsave::ShardReader& r, uint64_t max_header_bytes) {
        std::string header;
        {
          py::gil_scoped_release nogil;
          header = r.read_header(max_header_bytes);
        }
        return py::bytes(header);
      }, py::arg("max_header_bytes"))
      .def("read", [](const recsave::ShardReader& r, const U64Array& offsets, const U64Array& addresses,
                      const U64Array& lengths, py::object expected_crcs, int threads) {
        require_1d(offsets, "offsets", -1);
        py::ssize_t n = offsets.shape(0);
        require_1d(addresses, "addresses", n);
        require_1d(lengths, "lengths", n);
        bool verify = !expected_crcs.is_none();
        U32Array crcs;
        if (verify) {
          crcs = expected_crcs.cast<U32Array>();
          require_1d(crcs, "expected_crcs", n);
        }
        std::vector<recsave::ReadItem> items(n);
        auto o = offsets.unchecked<1>();
        auto a = addresses.unchecked<1>();
        auto l = lengths.unchecked<1>();
        for (py::ssize_t i = 0; i < n; ++i) {
          items[i] = {o(i), reinterpret_cast<void*>(static_cast<uintptr_t>(a(i))), l(i),
                      verify ? crcs.at(i) : 0u};
        }
        py::gil_scoped_release nogil;
        r.read(items.data(), items.size(), verify, threads);
      }, py::arg("offsets"), py::arg("addresses"), py::arg("lengths"), py::arg("expected_crcs") = py::none(),
      py::arg("threads") = 1,
      "Reads items into raw destination addresses; verifies CRC32Cs when expected_crcs is given.")
      .def("read_into", [](const recsave::ShardReader& r, uint64_t offset, py::buffer out) {
        py::buffer_info info = out.request(true);
        recsave::ReadItem item{offset, info.ptr, static_cast<uint64_t>(info.size * info.itemsize), 0};
        py::gil_scoped_release nogil;
        r.read(&item, 1, false, 1);
      }, py::arg("offset"), py::arg("out"), "Reads len(out) bytes at `offset` into a writable buffer.")
      .def("close", &recsave::ShardReader::close);
}
