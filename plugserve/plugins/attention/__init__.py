"""Attention backends (MLA: absorbed decode/extend over the paged latent cache, and MHA prefill)."""
