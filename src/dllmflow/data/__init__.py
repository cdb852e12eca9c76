"""Data: chat formats and mixing, the embedded datasets, tokenizers, prepare (the DVC stage), collate, the regeneration client."""
