"""Generators of the kernels that run a task graph: persistent kernels and their pieces."""
