"""Labels and selectors of the objects built for one InferenceDeployment."""

from __future__ import annotations

from kvpilot.operator import constants as c


def selector_labels(name: str) -> dict[str, str]:
    """The Deployment/Service/PDB selector. Stable for the object's lifetime: never add a
    label here that can change (a version, a hash), or running pods are orphaned."""
    return {c.LABEL_COMPONENT: c.ENGINE_COMPONENT, c.LABEL_OWNER: name}


def object_labels(name: str) -> dict[str, str]:
    """Labels on every child object and on the pods."""
    return {
        c.LABEL_NAME: c.ENGINE_NAME,
        c.LABEL_INSTANCE: name,
        c.LABEL_MANAGED_BY: c.FIELD_MANAGER,
        **selector_labels(name),
    }


def selector_string(name: str) -> str:
    """``selector_labels`` as the label-selector string the scale subresource reports."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(name).items()))


def router_name(name: str) -> str:
    """The name of the router's Deployment, Service, ServiceAccount, RoleBinding and PDB."""
    return name + c.ROUTER_SUFFIX


def router_selector_labels(name: str) -> dict[str, str]:
    """The router Deployment/Service/PDB selector (stable, like :func:`selector_labels`);
    never matches engine pods, so the engine Service and the router's discovery stay apart."""
    return {c.LABEL_COMPONENT: c.ROUTER_COMPONENT, c.LABEL_OWNER: name}


def router_object_labels(name: str) -> dict[str, str]:
    """Labels on every router object and pod (the owner label too: Prometheus copies it into
    the ``inference_deployment`` series label, as for engine pods)."""
    return {
        c.LABEL_NAME: c.ROUTER_NAME,
        c.LABEL_INSTANCE: name,
        c.LABEL_MANAGED_BY: c.FIELD_MANAGER,
        **router_selector_labels(name),
    }


def headroom_name(name: str) -> str:
    """The node-headroom placeholder Deployment's name."""
    return name + c.HEADROOM_SUFFIX


def headroom_selector_labels(name: str) -> dict[str, str]:
    """The placeholder pods' selector: another component, so the engine Service, PDB and
    fleet observation never count them."""
    return {c.LABEL_COMPONENT: c.HEADROOM_COMPONENT, c.LABEL_OWNER: name}


def headroom_object_labels(name: str) -> dict[str, str]:
    """Labels on the placeholder Deployment and its pods."""
    return {
        c.LABEL_NAME: c.ENGINE_NAME,
        c.LABEL_INSTANCE: name,
        c.LABEL_MANAGED_BY: c.FIELD_MANAGER,
        **headroom_selector_labels(name),
    }


def adapters_name(name: str) -> str:
    """The adapters ConfigMap's name (``spec.adapters``, loaded by the engine at start-up)."""
    return name + c.ADAPTERS_SUFFIX
