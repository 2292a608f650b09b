"""``kvpilot simulate``: the fleet simulator's command line and its outputs.

==========  ==================================================================
``cli``     flags -> :class:`~kvpilot.autoscaler.sim.Scenario` and a replica model
            -> :func:`~kvpilot.autoscaler.sim.compare` -> table, JSON
``plot``    the timeline PNG (matplotlib, imported only for ``--plot``)
==========  ==================================================================

The simulator itself is :mod:`kvpilot.autoscaler.sim`; this package sits beside the
autoscaler so that ``kvpilot.autoscaler`` stays standard library only (matplotlib is a
``dev`` extra). Nothing in ``kvpilot.autoscaler`` imports it.
"""
