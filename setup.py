# The cffi extension (abi/superfluid.h + abi/sf_ring.c) is built by the
# install itself; everything else is in pyproject.toml.
from setuptools import setup

setup(cffi_modules=["abi/_build.py:ffibuilder"])
