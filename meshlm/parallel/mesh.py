"""The process layout: a `pp × dp × cp × tp` DeviceMesh and its process groups, as one explicit object.

Rank r sits at mesh coordinate (pp, dp, cp, tp) with r = ((pp·D + dp)·C + cp)·T + tp: tensor-parallel
ranks are adjacent, so on a node of 8 GPUs a tp=8 group never leaves the node (NVLink), context-parallel
ranks (whose ring sends every layer's keys and values) come next, and data/pipeline groups cross nodes
where the traffic is lighter (Megatron's ordering). With cp > 1 there is also a `dp × cp` group (the
weights are replicated over both, so their gradients are reduced over both); at cp = 1 the mesh is
`pp × dp × tp` and that group is the dp group.

`init_distributed(cfg)` reads torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK), initialises the
default process group (gloo on CPU, NCCL when CUDA is available: chosen from the hardware, never from an
environment variable) and returns a `ParallelDims`. A world of one process needs no torch.distributed at
all: every group is None and every size 1. Nothing here is global; two layouts can coexist in one process
(tests build a tp=2 and a tp=4 layout inside one world of four).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from meshlm.core.config import ParallelConfig
from meshlm.core.layout import factor_world  # the world's factorisation is a layout rule (torch-free)

DIM_NAMES = ("pp", "dp", "cp", "tp")


def pick_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def default_device(local_rank: int = 0) -> torch.device:
    """cuda:LOCAL_RANK when a GPU is visible, else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


@dataclass
class ParallelDims:
    """Sizes, this process's coordinates, and the groups along each mesh dimension.

    Groups are None when the world is one process (then all sizes are 1 and nothing communicates).
    """

    pp: int = 1
    dp: int = 1
    tp: int = 1
    rank: int = 0
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    mesh: object | None = None  # torch.distributed.device_mesh.DeviceMesh
    pp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None
    tp_group: dist.ProcessGroup | None = None
    cp: int = 1
    cp_group: dist.ProcessGroup | None = None  # None when cp = 1
    dpcp_group: dist.ProcessGroup | None = None  # the weights' replicas: dp × cp (the dp group when cp = 1)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    @property
    def coords(self) -> tuple[int, int, int]:
        """(pp_rank, dp_rank, tp_rank) of this process (`cp_rank` is the fourth coordinate)."""
        pp_rank, rest = divmod(self.rank, self.dp * self.cp * self.tp)
        dp_rank, rest = divmod(rest, self.cp * self.tp)
        return pp_rank, dp_rank, rest % self.tp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def dpcp(self) -> int:
        """Replicas of every weight: dp × cp ranks hold the same parameters (gradients reduced over them)."""
        return self.dp * self.cp

    @property
    def dpcp_rank(self) -> int:
        """This rank's index in the dp × cp group (dp major, cp minor)."""
        return self.dp_rank * self.cp + self.cp_rank

    @property
    def dpcp_mesh(self):
        """The 1-D DeviceMesh of the dp × cp group (what ZeRO-3 shards over): the mesh's dp dimension when
        cp = 1, else one built over `dpcp_group` (once)."""
        if self.cp == 1:
            return self.mesh["dp"]
        if "_dpcp_mesh" not in self.__dict__:
            from torch.distributed.device_mesh import DeviceMesh

            self.__dict__["_dpcp_mesh"] = DeviceMesh.from_group(self.dpcp_group, self.device.type,
                                                                mesh_dim_names=("dp_cp",))
        return self.__dict__["_dpcp_mesh"]

    @property
    def tp_rank(self) -> int:
        return self.coords[2]

    @property
    def dp_rank(self) -> int:
        return self.coords[1]

    @property
    def pp_rank(self) -> int:
        return self.coords[0]

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that logs, writes metrics and publishes checkpoints."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    @classmethod
    def build(cls, tp: int = 1, pp: int = 1, dp: int = 0, *, cp: int = 1, timeout_s: float = 600.0,
              device: torch.device | None = None) -> ParallelDims:
        """The layout over the already-initialised default process group (or a world of one).

        Every group is created with `timeout_s`, so a rank that died makes the others fail instead of hang.
        `new_group` is collective: every rank must call `build` with the same arguments, in the same order.
        """
        world = dist.get_world_size() if dist.is_initialized() else 1
        rank = dist.get_rank() if dist.is_initialized() else 0
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        device = device or default_device(local_rank)
        pp, dp, tp = factor_world(world, tp, pp, dp, cp)
        if world == 1:
            return cls(pp, dp, tp, rank, 0, device)
        from torch.distributed.device_mesh import DeviceMesh

        names = DIM_NAMES if cp > 1 else tuple(n for n in DIM_NAMES if n != "cp")
        sizes = {"pp": pp, "dp": dp, "cp": cp, "tp": tp}
        layout = torch.arange(world, dtype=torch.int).view(*(sizes[n] for n in names))  # tp innermost
        timeout = timedelta(seconds=timeout_s)
        groups = {}
        for axis, name in enumerate(names):
            # All groups along one axis: the mesh's 1-D slices, rank lists in the other axes' order.
            groups[name] = _slice_groups(layout.movedim(axis, -1).reshape(-1, layout.shape[axis]), rank, timeout)
        if cp > 1:  # dp × cp: the (dp, cp) planes, ranks dp major
            groups["dpcp"] = _slice_groups(layout.movedim(-1, 1).reshape(pp * tp, dp * cp), rank, timeout)
        mesh = DeviceMesh.from_group([groups[n] for n in names], device.type, mesh=layout, mesh_dim_names=names)
        return cls(pp, dp, tp, rank, local_rank, device, mesh, groups["pp"], groups["dp"], groups["tp"], cp,
                   groups.get("cp"), groups.get("dpcp", groups["dp"]))


def _slice_groups(slices: torch.Tensor, rank: int, timeout: timedelta) -> dist.ProcessGroup:
    """One group per row of `slices` (collective: every rank creates every group); this rank's."""
    mine = None
    for ranks in slices.tolist():
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def init_distributed(cfg: ParallelConfig, device: torch.device | None = None) -> ParallelDims:
    """Initialise torch.distributed from torchrun's environment and build the layout for `cfg`.

    Outside torchrun (no WORLD_SIZE, or WORLD_SIZE=1) this touches no process group at all.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = device or default_device(local_rank)
    if world > 1 and not dist.is_initialized():
        factor_world(world, cfg.tp, cfg.pp, cfg.dp, cfg.cp)  # fail with the config error before any rendezvous wait
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(pick_backend(device), timeout=timedelta(seconds=cfg.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    return ParallelDims.build(cfg.tp, cfg.pp, cfg.dp, cp=cfg.cp, timeout_s=cfg.timeout_s, device=device)


def destroy(wait_for_all: bool = False) -> None:
    """Tear down every process group (safe to call when none exists). After a run that ended well, pass
    `wait_for_all`: a barrier first, so that no rank tears gloo down while another still talks to it (that
    can abort the other with "terminate called without an active exception"). After an error, don't:
    the other ranks may be gone, and the barrier would wait for its timeout."""
    if dist.is_initialized():
        if wait_for_all:
            dist.barrier()
        dist.destroy_process_group()
