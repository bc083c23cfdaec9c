"""The model: its config, FP8 blocks and the FP8 linear layer (fp8, fp8_linear, and fp8_triton's GPU kernels), the
paged batch, DeepSeek-V3 + MTP, its tensor/expert-parallel split (parallel), and the CPU kernels."""
