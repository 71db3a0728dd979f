#pragma once
#include <pybind11/pybind11.h>

// Registers class IdMap (the CPU id -> row map of csrc/core/id_map.h) on the module.
void bind_idmap(pybind11::module_& m);
