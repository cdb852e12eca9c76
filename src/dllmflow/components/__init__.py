"""The torchx CLI entry: `torchx run dllmflow.components:train` (the trainer component).

`train` is defined in `dllmflow.training.component`, which wraps `dllmflow.training.launch.build_app`.

    torchx run -s local_cwd dllmflow.components:train --params params/tiny_mdlm.yaml --set train.max_steps=2
    torchx run --dryrun -s kubernetes dllmflow.components:train --params params/x.yaml --nnodes 2 --gpu 8

torchx 0.7 resolves `X:Y` as FILE:FUNCTION from the working directory, so these commands run from the
repo root, where `dllmflow.components` is a link to src/dllmflow/training/component.py (and
./.torchxconfig holds the scheduler settings). Python callers import it:

    from dllmflow.components import train
    app = train(params="params/tiny_mdlm.yaml", nnodes=2)
"""

from dllmflow.training.component import train

__all__ = ["train"]
