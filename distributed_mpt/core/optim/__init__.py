"""Optimization: parameter groups (groups.py), their update rules (rules.py),
the one optimizer that applies them (optimizer.py), the learning-rate
schedules (schedules.py) and airbench's lookahead (lookahead.py)."""
