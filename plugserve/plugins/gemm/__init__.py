"""Block-FP8 GEMM backends."""
