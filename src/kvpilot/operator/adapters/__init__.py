"""LoRA adapters in running engine pods: the operator keeps every ready pod serving
exactly ``spec.adapters`` through the engine's runtime LoRA API.

==============  ==================================================================
module          does
==============  ==================================================================
``engine_api``  one pod's ``GET /v1/models``, ``POST /v1/load_lora_adapter`` and
                ``POST /v1/unload_lora_adapter`` (httpx, bounded timeouts)
``sync``        what to unload and load per pod (pure), the fleet's round (pods in
                parallel, one pod's failure never stops another) and the status
``loop``        the per-resource Kopf daemon: a round every 30 s and within a second
                of a spec change; ``status.adapters``, AdaptersReady, Events
==============  ==================================================================

A pod that starts loads the list itself (``--lora-adapters-file``, the ConfigMap
NAME-adapters) before it reports ready, so the sync only has running pods to change.
The operator never reads a Secret: the engines fetch the adapters with the credentials
in their own environment.
"""
