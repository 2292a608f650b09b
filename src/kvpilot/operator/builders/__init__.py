"""Pure builders: a validated spec in, plain Kubernetes objects (dicts) out.

No I/O and no clock: the same inputs always give the same objects, so server-side apply
is idempotent and the builders are table-tested (``tests/operator/test_builders.py``).
"""

from kvpilot.operator.builders.children import Children, Owner, build_children

__all__ = ["Children", "Owner", "build_children"]
