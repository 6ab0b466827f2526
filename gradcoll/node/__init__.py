"""gradcoll.node: a platform-neutral node driver (configure, connect, serve stages, train).

Everything a node needs to join a group and serve work, with no environment
variables read unless asked (``NodeConfig.from_env``), no process spawning
and no stdout contract: results come back as frozen report objects, so a
mobile or embedded shell can link it:

    cfg = NodeConfig(1, 3).peers(["10.0.0.1:29500"]).device("auto")   # one address: star
    group = cfg.connect(timeout=60)
    report = serve_worker(group, resolve=None)     # file:// .npy weights

Rank 0 is the coordinator: ``collect_caps``, ``ship_stage``,
``drive_pipeline`` for a pipeline; ``coordinate_trainer`` (or
``ship_train_spec`` + ``run_trainer``) for data-parallel training.
Stages and train specs are JSON data over a fixed op registry; nothing a
peer sends is unpickled or executed. See docs/node.md.
"""

from __future__ import annotations

from ..group.process_group import ProcessGroup
from .caps import NodeCaps, NodeRole, collect_caps, node_device, platform_tag, send_caps
from .config import NodeConfig, NodeGroup, PeerSource, Topology, connect_local, topology_of
from .control import NodeControl, NodeStopHandle
from .errors import RemoteStageError, StageRefused
from .fixed_function import FixedFunction, FixedFunctionDevice, LoopbackFixedFunction
from .ops import OPS
from .reduce import group_mean, mean_reduce
from .serve import NodeReport, drive_pipeline, serve_fixed_function_n, serve_worker, serve_worker_n, ship_stage
from .stage import OpSpec, Stage, StageSpec, compile_stage
from .trainer import TrainMetrics, TrainReport, coordinate_trainer, run_trainer, serve_trainer, serve_trainer_here, ship_train_spec, train_local
from .trainspec import DataSpec, TrainSpec
from .weights import WeightCache, weight_cache

__all__ = [
    # configuration and connection
    "NodeConfig", "PeerSource", "Topology", "ProcessGroup", "NodeGroup", "topology_of", "connect_local",
    # capabilities and roles
    "NodeRole", "NodeCaps", "platform_tag", "node_device", "send_caps", "collect_caps",
    # serving a pipeline
    "StageSpec", "OpSpec", "OPS", "Stage", "compile_stage", "WeightCache", "weight_cache",
    "NodeControl", "NodeStopHandle", "NodeReport", "serve_worker", "serve_worker_n",
    "ship_stage", "drive_pipeline",
    # fixed-function hardware
    "FixedFunction", "FixedFunctionDevice", "LoopbackFixedFunction", "serve_fixed_function_n",
    # training
    "TrainSpec", "DataSpec", "TrainMetrics", "TrainReport", "serve_trainer", "serve_trainer_here",
    "run_trainer", "ship_train_spec", "coordinate_trainer", "train_local", "group_mean",
    "mean_reduce",  # the old name of group_mean
    # errors
    "StageRefused", "RemoteStageError",
]
