"""Inference: text generation from a checkpoint and an OpenAI-compatible server."""
