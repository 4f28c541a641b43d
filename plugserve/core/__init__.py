"""What every model run needs: the backend contracts, the batch layout, the KV pool, the model and its layers.

No optional package is imported at module import. Its kernel code is the model's fused small ops
(layers/triton_small_ops.py), the batch layout's positions and KV slots (triton_forward_batch.py) and the
programmatic dependent launch the decode path's Triton kernels share (triton_pdl.py): Triton modules imported
lazily, on CUDA or by tests.
"""
