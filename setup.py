# The cffi extensions (abi/superfluid.h + abi/sf_ring.c; kernels/sf_cpu.c) and the
# codec's C fast path (abi/sf_codec.c) are built by the install itself; everything
# else is in pyproject.toml.
from setuptools import Extension, setup

setup(cffi_modules=["abi/_build.py:ffibuilder", "kernels/_build_cpu.py:ffibuilder"],
      ext_modules=[Extension("superfluid.abi._codec", ["abi/sf_codec.c"], extra_compile_args=["-O2"])])
