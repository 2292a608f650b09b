"""The Kopf operator for ``InferenceDeployment`` resources. Never imports the engine,
the kernels, torch or triton: it talks to engines over HTTP and PromQL only."""
