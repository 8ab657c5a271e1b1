"""The CPU kernel tests need the compiled library; they are skipped where no C compiler exists."""

import pytest

from pagedllm.cpu.build import configure_cpu_threads, load_cpu_kernels


@pytest.fixture(scope="session")
def cpu_kernels():
    lib = load_cpu_kernels()
    if lib is None:
        pytest.skip("the CPU kernels cannot be built here (no C compiler)")
    configure_cpu_threads(2)  # two workers even on one core: the pool's job splitting is exercised
    return lib
