"""Stale-input skipping (Slipstream): which rows have stopped moving, and skipping the inputs that touch only them."""
