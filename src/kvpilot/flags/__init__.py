"""The serve flags in one place, standard library only (the operator imports it; it must
not import the engine or torch).

- :mod:`kvpilot.flags.serve`: ``kvpilot serve``'s own flags, one table: the argparse
  arguments, ``EngineArgs``'s defaults and the operator's managed flags come from it.
- :mod:`kvpilot.flags.vllm`: the ``vllm serve`` flags kvpilot does not have, each a no-op
  here or refused, with the reason.
- :mod:`kvpilot.flags.check`: both tables on an argparse parser, checking a vLLM command
  line (``kvpilot serve`` and the operator's ``engine.extraArgs``).
- :mod:`kvpilot.flags.docs`: docs/server.md's tables of vLLM flags, generated.
"""
