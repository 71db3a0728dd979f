#pragma once
#include <pybind11/pybind11.h>

// Registers arm_exit_status / disarm_exit_status: the exit status of a process whose async save's
// background write failed with nobody hearing of it (recsave/save/background.py).
void bind_exit(pybind11::module_& m);
