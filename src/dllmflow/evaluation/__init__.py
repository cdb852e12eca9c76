"""Evaluation: accuracy and decoding speed per sampler, DFlash acceptance, the lm-eval adapter."""
