"""Build of the one C extension, ``yuebing.transfer._streamcopy`` (large copies with streaming
stores). Everything else is in pyproject.toml. ``optional=True``: without a C compiler the
install still succeeds and `yuebing.transfer.streamcopy` falls back to ``numpy.copyto``."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("yuebing.transfer._streamcopy",
                             ["src/yuebing/transfer/_streamcopy.c"],
                             extra_compile_args=["-O2"], optional=True)])
