"""Choosing and predicting: balances from layer costs, plans, simulated steps, calibration."""
