"""Starting or joining a Ray cluster, loopback-only unless told otherwise."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("jaxloom.ray")

LOOPBACK = "127.0.0.1"


def init_ray(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    include_dashboard: bool = False,
    namespace: str | None = "jaxloom",
    **kwargs: Any,
) -> dict:
    """Start a local Ray cluster bound to 127.0.0.1 (no address) or connect to an existing one
    (`address="ray://host:10001"` or `"auto"`; without `address`, the `RAY_ADDRESS` environment
    variable, Ray's convention). Returns `ray.init`'s context as a dict. A new local cluster gets
    `num_cpus`/`num_gpus` (None: what the machine has); actors live in `namespace`.

    Locally, Ray would otherwise bind its gRPC ports on every interface: this sets
    `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` for the processes it starts (measured on Ray 2.60: with it,
    every port is on 127.0.0.1). The dashboard stays off unless `include_dashboard=True`, and then it
    listens on 127.0.0.1 too. Calling it again when Ray is up returns the running cluster's context.
    """
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:  # read by every Ray process when it imports ray
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if address is None and os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "0":
        # This process may have imported ray before the variable was set: its copy decides too.
        from ray._private import ray_constants

        if getattr(ray_constants, "ENABLE_RAY_CLUSTER", False):
            ray_constants.ENABLE_RAY_CLUSTER = False

    if ray.is_initialized():
        return {"address": _gcs_address(), "dashboard_url": None}
    if address is None:
        kwargs.setdefault("_node_ip_address", LOOPBACK)
        kwargs.setdefault("dashboard_host", LOOPBACK)
        ctx = ray.init(
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=include_dashboard,
            namespace=namespace,
            log_to_driver=kwargs.pop("log_to_driver", True),
            **kwargs,
        )
    else:
        if num_cpus is not None or num_gpus is not None:
            raise ValueError(
                "num_cpus/num_gpus describe a new local cluster; an existing one (address="
                f"{address!r}) has its own resources"
            )
        ctx = ray.init(address=address, namespace=namespace, **kwargs)
    info = {
        "address": getattr(ctx, "address_info", {}).get("address") or _gcs_address(),
        "dashboard_url": getattr(ctx, "dashboard_url", None),
    }
    log.info("ray: %s", info)
    return info


def _gcs_address() -> str | None:
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - informational only
        return None


def shutdown_ray() -> None:
    """Disconnect from (and, if this process started it, stop) the Ray cluster."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
