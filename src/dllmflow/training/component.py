"""torchx component `dllmflow.train`: settings resolved once, then `build_app`'s AppDef, which carries them.

The AppDef runs torchrun -> `python -m dllmflow.training.main --run-dir RUN`, the settings inline in its
environment ($DLLMFLOW_SETTINGS): the submitting machine writes nothing, and rank 0 records them as
RUN/settings.json on its own disk.

torchx finds it through the package's entry point (pyproject.toml, group `torchx.components`:
`dllmflow = dllmflow.training.component`), so it runs from any directory where dllmflow is installed.
Scheduler settings (queue, namespace, partition, no workspace patching) come from a .torchxconfig:
the one named by $TORCHXCONFIG (infra/.torchxconfig is the project's), else ~/.torchxconfig and
./.torchxconfig:

    export TORCHXCONFIG=$PWD/infra/.torchxconfig
    torchx run -s local_cwd dllmflow.train --params params/tiny_mdlm.yaml --set train.max_steps=2
    torchx run --dryrun -s kubernetes dllmflow.train --params params/x.yaml \\
        --nnodes 2 --nproc_per_node 8 --gpu 8 --image registry/dllmflow:tag \\
        --mounts type=volume,src=dllmflow-runs,dst=/app/runs --run_dir /app/runs/x

Arguments left unset keep the recipe's `launch:` values. No node reads a file the submitting machine
wrote: with `checkpoint.remote_dir` set, `run_dir` may be each pod's own disk (infra/README.md).

Annotations are `typing` generics on purpose: torchx 0.7's component linter reads the source and accepts
only `Optional`/`Dict`/`List` (and `from __future__ import annotations` would hide the types from its
argument parser).
"""

from typing import Dict, List, Optional

from torchx import specs

# The module, not its functions: torchx offers every function of this module as a component.
from dllmflow.training import launch as _launch


def train(
    params: str,
    nnodes: Optional[int] = None,
    nproc_per_node: Optional[int] = None,
    image: Optional[str] = None,
    cpu: Optional[int] = None,
    gpu: Optional[int] = None,
    memMB: Optional[int] = None,
    env: Optional[Dict[str, str]] = None,
    mounts: Optional[List[str]] = None,
    run_dir: Optional[str] = None,
    resume: bool = False,
    rdzv_endpoint: Optional[str] = None,
    max_restarts: Optional[int] = None,
    set: Optional[Dict[str, str]] = None,
) -> specs.AppDef:
    """Fine-tune a diffusion LM: torchrun on nnodes x nproc_per_node workers running dllmflow.training.main.

    Args:
        params: recipe YAML(s), comma-separated; later ones override earlier ones
        nnodes: number of nodes (torchx replicas); unset = launch.nnodes
        nproc_per_node: trainer processes per node (one per GPU); unset = launch.nproc_per_node
        image: container image (cluster schedulers); unset = launch.image
        cpu: CPUs per node; unset = launch.resources.cpu
        gpu: GPUs per node; unset = launch.resources.gpu
        memMB: memory per node in MB; unset = launch.resources.memory_mb
        env: extra environment, e.g. NCCL_DEBUG=INFO,HF_HOME=/cache/hf (added to launch.env)
        mounts: torchx mounts, e.g. type=volume,src=dllmflow-runs,dst=/app/runs (replace launch.mounts)
        run_dir: where settings.json, checkpoints and logs go (each node's own disk with checkpoint.remote_dir); unset = runs/<name>
        resume: continue from RUN/checkpoints/LATEST
        rdzv_endpoint: c10d host:port; unset = the rank-0 node's host on port 29500 when nnodes > 1
        max_restarts: torchrun restarts of a failed worker group; unset = launch.max_restarts
        set: settings overrides, e.g. train.max_steps=2,dataset.limit=16 (values parse as YAML)

    Returns:
        the trainer AppDef (one role, nnodes replicas)
    """
    from dllmflow.settings import load_settings

    overrides = _launch.parse_overrides([f"{k}={v}" for k, v in (set or {}).items()])
    launch = {
        key: value
        for key, value in {
            "launch.nnodes": nnodes,
            "launch.nproc_per_node": nproc_per_node,
            "launch.image": image,
            "launch.resources.cpu": cpu,
            "launch.resources.gpu": gpu,
            "launch.resources.memory_mb": memMB,
            "launch.mounts": mounts,
            "launch.rdzv_endpoint": rdzv_endpoint,
            "launch.max_restarts": max_restarts,
            "launch.env": env,  # merges into the recipe's launch.env
            "run_dir": run_dir,
        }.items()
        if value is not None
    }
    settings = load_settings(*params.split(","), **{**overrides, **launch})
    run = settings.resolved_run_dir.absolute()
    # The CLI does not tell a component its scheduler: use the rank-0 host, which every torchx
    # scheduler names (local_cwd: localhost), rather than a free port that only a local run could use.
    lc = settings.launch
    endpoint = None if lc.rdzv_endpoint or lc.nnodes == 1 else _launch.rank0_endpoint()
    return _launch.build_app(settings, run, resume=resume, endpoint=endpoint)
