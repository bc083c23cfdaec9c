"""Files: checkpoints (read and validated), the engine format, loading into final form, the tokenizer."""
