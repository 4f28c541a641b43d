"""Comm backends: the all-reduces between tensor-parallel ranks."""
