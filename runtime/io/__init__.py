"""Files: checkpoints (read and validated), the engine format, loading into final form, weights as a release stores
them (weights), the tokenizer, YAML read safely (yaml_file), and writes that leave nothing half-written (atomic)."""
