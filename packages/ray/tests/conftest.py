import os
import sys

# 8 simulated CPU devices; must be set before JAX starts its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(__file__))  # helpers beside the tests (importlib import mode)
# Ray workers inherit the environment: let them import the helpers the test functions use.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(__file__), os.environ.get("PYTHONPATH")) if p)

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def ray_cluster():
    """One real local Ray cluster for the session (starting one costs ~7 s). Yields the TCP ports that
    began listening while it started."""
    from jaxloom.ray import init_ray, shutdown_ray
    from jaxloom.ray.testing import listening_addresses

    before = listening_addresses()
    info = init_ray(num_cpus=8)
    import time

    time.sleep(1.0)  # let every Ray process open its ports
    yield {"info": info, "new_listeners": listening_addresses() - before}
    shutdown_ray()
