"""Models: build_* on the meta device, adapters a mode needs, LoRA, mask ids, generation limits, model cards."""
