"""The model: its config, FP8 blocks, the paged batch, DeepSeek-V3 + MTP, and the CPU kernels."""
