"""PyTorch on gradcoll (optional extra ``torch``): a ``torch.distributed`` backend, DDP's comm hook, gradient sync.

Importing this package registers the ``torch.distributed`` backend
``"gradcoll"`` (`gradcoll.torch.backend`), so a torch script switches with one
word:

```python
import gradcoll.torch  # registers the backend
dist.init_process_group("gradcoll")  # was "gloo"
```

DDP, torchrun and the collectives the script already calls then run on
gradcoll. Without torch.distributed: [`sync_gradients`][gradcoll.torch.sync.sync_gradients]
and [`GradientSynchronizer`][gradcoll.torch.sync.GradientSynchronizer]
average ``.grad`` over a gradcoll group (`gradcoll.torch.sync`); for a job
that keeps gloo or nccl, [`comm_hook`][gradcoll.torch.hook.comm_hook] averages
DDP's buckets on a gradcoll group. See docs/torch.md.

Under Open MPI's ``mpirun`` (or an MPI launcher setting ``PMI_RANK``), where
torch's ``env://`` finds no ``RANK`` and ``WORLD_SIZE``, importing this
package sets them (and ``LOCAL_RANK``, and ``MASTER_ADDR`` / ``MASTER_PORT``
to 127.0.0.1:29500 where unset) from the launcher's variables, so
``dist.init_process_group("gradcoll")`` runs under mpirun too. Variables
already set are never changed.
"""

from __future__ import annotations

import os

from ..group.rendezvous import DEFAULT_PORT
from ._tensors import NonFiniteGradientError, UnsupportedError
from .backend import BACKEND, GradcollProcessGroup, Options, register
from .hook import comm_hook
from .sync import GradientSynchronizer, broadcast_state, check_same_layout, make_buckets, sync_gradients

__all__ = ["sync_gradients", "GradientSynchronizer", "make_buckets", "broadcast_state", "check_same_layout",
           "comm_hook", "GradcollProcessGroup", "Options", "register", "BACKEND", "NonFiniteGradientError",
           "UnsupportedError"]

_MPI_VARS = (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
             ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"))


def _mpi_environment(env: dict[str, str] | os._Environ[str]) -> None:
    """Give torch's ``env://`` the ``RANK``/``WORLD_SIZE`` an MPI launcher expresses in its own variables."""
    if env.get("RANK") or env.get("WORLD_SIZE"):
        return
    for rank, size, local in _MPI_VARS:
        if env.get(rank) and env.get(size):
            env["RANK"], env["WORLD_SIZE"] = env[rank], env[size]
            env.setdefault("LOCAL_RANK", env.get(local) or "0")
            env.setdefault("MASTER_ADDR", "127.0.0.1")
            env.setdefault("MASTER_PORT", str(DEFAULT_PORT))
            return


_mpi_environment(os.environ)
register()
