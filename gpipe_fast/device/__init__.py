"""Streams, events and boundary copies of CPU and CUDA cells, and the native recompute pools."""
