"""The suite's setup, before any test module imports JAX: the persistent compilation cache (shared
by the pytest-xdist workers and the processes the tests start), XLA's CPU backend without LLVM's
optimisation passes, 8 simulated devices. And the slow tests first: pytest-xdist's load
scheduling then hands them out one at a time and the fast ones fill the end (pytest.ini gives the
measured times)."""

import os
import tempfile
import warnings

import pytest


def pytest_configure(config):
    # Set before JAX starts, so that every subprocess a test starts inherits it too.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.environ.get(
        "SPIKEFIX_TEST_JAX_CACHE", os.path.join(tempfile.gettempdir(), "spikefix-test-jax-cache")))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    # XLA's CPU backend without LLVM's optimisation passes, without its fusion emitters (the
    # older loop emitter instead) and without LLVM's expensive passes: compiles take most of the
    # suite's time, and the tests' models are too small for the faster code to pay (each flag
    # cut compile-bound tests by 10-33%, cold, on an AMD EPYC and an Intel Xeon). The same
    # program, compiled with fewer passes: the tests' comparisons are between runs compiled alike.
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""),
                                        "--xla_backend_optimization_level=0",
                                        "--xla_cpu_use_fusion_emitters=false",
                                        "--xla_llvm_disable_expensive_passes=true"]).strip()

    import jax

    jax.config.update("jax_num_cpu_devices", 8)


@pytest.hookimpl(trylast=True)  # after pytest-xdist's own, which names each test's group
def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: file order
    # pytest.ini's loadgroup sends the tests of one xdist_group to one worker by the group's name
    # that pytest-xdist appends to their ids; where it cannot (pytest 9 with pytest-xdist 3.8),
    # the two-process tests would run side by side, each worker building their fixtures.
    if config.getoption("loadgroup", False):
        lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in
                i.nodeid]
        if lost:  # (a warning: the tests still pass, only slower)
            warnings.warn(f"pytest-xdist's loadgroup did not group {lost[0]} and {len(lost) - 1}"
                          " more: they run side by side; install requirements.txt's pytest",
                          stacklevel=2)
