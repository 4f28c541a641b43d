"""Kernel backends, one sub-package per kind; each module is a plugin registering through `plugserve_backends`."""
