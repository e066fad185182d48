"""Kernels below the model and parallel layers: packed attention and its host metadata."""
