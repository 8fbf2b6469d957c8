"""Balancing: layers profiled (time, size, parameters) and cut into cells, for balance=None."""
