# The cffi extensions (abi/superfluid.h + abi/sf_ring.c; kernels/sf_cpu.c) are built by the
# install itself; everything else is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["abi/_build.py:ffibuilder", "kernels/_build_cpu.py:ffibuilder"])
