"""``kvpilot serve``'s option strings, for checking ``engine.extraArgs`` as the engine will
(:func:`kvpilot.vllm_flags.split_vllm_flags`) without importing the engine, which the
operator must not (it would pull in torch).

A copy of what ``kvpilot.engine.server.cli.add_arguments`` puts on the parser;
``tests/operator/test_extra_args.py`` fails, naming the difference, when the two drift
apart (a flag added to the engine must be added here, or the operator refuses it as
unknown).
"""

from __future__ import annotations

# option string -> whether it takes a value
SERVE_OPTIONS: dict[str, bool] = {
    "-h": False, "--help": False,
    # server
    "--host": True, "--port": True, "--api-key": True, "--drain-timeout": True,
    "--max-request-body-bytes": True, "--log-level": True,
    # chat (vLLM's flags)
    "--enable-auto-tool-choice": False, "--tool-call-parser": True, "--reasoning-parser": True,
    "--chat-template": True,
    # engine (EngineArgs.add_cli_args)
    "--model": True, "--served-model-name": True, "--tokenizer": True, "--dtype": True,
    "--device": True, "--kv-cache-dtype": True, "--block-size": True,
    "--max-num-batched-tokens": True, "--max-num-seqs": True, "--max-model-len": True,
    "--enable-prefix-caching": False, "--no-enable-prefix-caching": False,
    "--gpu-memory-utilization": True, "--num-gpu-blocks-override": True,
    "--kv-cache-memory": True, "--attention-backend": True, "--load-format": True,
    "--seed": True, "--kv-cache-key-rotation": False, "--no-kv-cache-key-rotation": False,
    "--kv-cache-skip-layers": True, "--calculate-kv-scales": False,
    "--skip-tokenizer-init": False, "--kv-events-config": True,
    "--disable-sliding-window": False, "--no-disable-sliding-window": False,
    "--tensor-parallel-size": True, "-tp": True,
}
