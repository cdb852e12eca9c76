"""Workflow: what the Metaflow steps call (finetune, regenerate) and the run card."""
