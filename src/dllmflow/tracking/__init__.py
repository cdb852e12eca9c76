"""Tracking: the MLflow run, the registered pyfunc model, the registry gate and lineage."""
