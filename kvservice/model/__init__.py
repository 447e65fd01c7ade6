"""The model: the transformer, its kernels, checkpoint loading (safetensors, GGUF), the
model families, the bundled model, and the one KV producer."""
