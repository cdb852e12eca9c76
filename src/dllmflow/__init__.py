"""dllmflow: fine-tune diffusion language models with Metaflow, torchx, MLflow and DVC."""

__version__ = "0.1.0"
