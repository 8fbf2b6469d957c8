"""Across processes: layouts, bounded waits, process groups, reductions, the dist transport."""
