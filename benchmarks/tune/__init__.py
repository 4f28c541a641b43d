"""Tuners: search launch configurations on the GPU and write the tuned files the backends read."""
