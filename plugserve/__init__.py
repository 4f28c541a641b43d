"""plugserve: a lean serving core for DeepSeek-V3-style models whose kernels are plugins."""

from plugserve.core import moved

__version__ = "0.1.0"

moved.install()
