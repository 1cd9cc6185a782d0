"""The one build step pyproject.toml cannot say: the timeslice-vmm shim (`shim/timeslice_vmm.c`).

A plain C shared library that job processes load with LD_PRELOAD (backend `vmm`,
`timeslice.driver.vmm_shim`); built as an extension module so that `pip install` compiles it
with the machine's C compiler on every machine that installs the package. It includes no
Python or CUDA header and links only libdl and libpthread.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension(
    "timeslice.driver._timeslice_vmm",
    sources=["shim/timeslice_vmm.c"],
    libraries=["dl", "pthread"],
    # no -Werror: a newer compiler's new warning must not fail an install
    extra_compile_args=["-O2", "-fvisibility=hidden", "-Wall", "-Wextra"],
)])
