"""Model building blocks: linear (incl. block-FP8), RMSNorm, rotary embedding, quantization utilities."""
