#pragma once
#include <pybind11/pybind11.h>

// Registers the hash-table helpers (row initialisation, bucket mapping) on the module.
void bind_table(pybind11::module_& m);
