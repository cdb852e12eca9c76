"""Evaluation: accuracy and decoding speed per sampler, DFlash acceptance."""
