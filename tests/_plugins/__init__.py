"""Test-only plugins: fault injection into the Trainer from outside the product code (fault_hooks.py)."""
