# The cffi module compiled from the C kernels (kernels/_build_cpu.py). Its members
# are sf_cpu.h's: cffi makes them at build time, so they are Any here.
from typing import Any

ffi: Any
lib: Any
