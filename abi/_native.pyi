# The cffi module compiled from superfluid.h and sf_ring.c (abi/_build.py). Its
# members are the header's: cffi makes them at build time, so they are Any here.
from typing import Any

ffi: Any
lib: Any
