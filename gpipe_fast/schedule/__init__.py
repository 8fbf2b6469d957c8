"""Schedules by name: the native registry of kinds and actions, and the per-pipe cache."""
