#pragma once
#include <pybind11/pybind11.h>

// Registers crc32c*, ShardWriter, ShardReader and fsync_directory on the module.
void bind_io(pybind11::module_& m);
