"""Model definitions and loading (Llama-family decoders from GGUF or a HF folder)."""
