"""Numerical kernels. Each has a portable jnp/XLA path; TPU-specific paths are chosen in one place per kernel.

This package imports nothing else from Moray.
"""
