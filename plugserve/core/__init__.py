"""What every model run needs; no kernel code, and no optional package imported at module import."""
