"""Diffusion math: one ModeSpec per mode (modes.py), corruption, schedules, losses, masks, strategies and samplers."""
