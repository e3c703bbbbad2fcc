"""The process layout: a `pp × dp × cp × tp` DeviceMesh and its process groups, as one explicit object.

Rank r sits at mesh coordinate (pp, dp, cp, tp) with r = ((pp·D + dp)·C + cp)·T + tp: tensor-parallel
ranks are adjacent, so on a node of 8 GPUs a tp=8 group never leaves the node (NVLink), context-parallel
ranks (whose ring sends every layer's keys and values) come next, and data/pipeline groups cross nodes
where the traffic is lighter (Megatron's ordering). With cp > 1 there is also a `dp × cp` group (the
weights are replicated over both, so their gradients are reduced over both); at cp = 1 the mesh is
`pp × dp × tp` and that group is the dp group. Expert parallelism (`ep` > 1, `expert.py`) is carved from
the dp × cp ranks of one (pp, tp) coordinate: index i (`dpcp_rank`) is in ep group i // ep (ep consecutive
indices, which hold different experts) and in expert-data-parallel group i % ep (the dp·cp/ep ranks that
hold the same experts and reduce their gradients).

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
from meshlm.core.errors import ConfigError
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
    ep: int = 1
    ep_group: dist.ProcessGroup | None = None  # ranks that split the experts (None when ep = 1)
    edp_group: dist.ProcessGroup | None = None  # ranks holding the same experts (None when ep = 1)

    @property
    def ep_rank(self) -> int:
        """This rank's index in its expert-parallel group: it holds experts [ep_rank·E/ep, (ep_rank+1)·E/ep)."""
        return self.dpcp_rank % self.ep

    @property
    def edp(self) -> int:
        """Replicas of each expert: dp × cp / ep ranks."""
        return self.dpcp // self.ep

    @property
    def edp_rank(self) -> int:
        return self.dpcp_rank // self.ep

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
    def build(cls, tp: int = 1, pp: int = 1, dp: int = 0, *, cp: int = 1, ep: int = 1, timeout_s: float = 600.0,
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
        if (dp * cp) % ep:
            raise ConfigError(f"parallel.ep={ep} is carved from the dp × cp = {dp * cp} ranks holding the same "
                              f"weights, which it does not divide; use an ep that divides {dp * cp}")
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
        if ep > 1:  # per (pp, tp): the dp × cp indices in blocks of ep (ep groups) and strided by ep (edp groups)
            planes = layout.reshape(pp, dp * cp, tp).movedim(-1, 1).reshape(pp * tp, dp * cp // ep, ep)
            groups["ep"] = _slice_groups(planes.reshape(-1, ep), rank, timeout)
            groups["edp"] = _slice_groups(planes.movedim(-1, 1).reshape(-1, dp * cp // ep), rank, timeout)
        mesh = DeviceMesh.from_group([groups[n] for n in names], device.type, mesh=layout, mesh_dim_names=names)
        return cls(pp, dp, tp, rank, local_rank, device, mesh, groups["pp"], groups["dp"], groups["tp"], cp,
                   groups.get("cp"), groups.get("dpcp", groups["dp"]), ep, groups.get("ep"), groups.get("edp"))


def _slice_groups(slices: torch.Tensor, rank: int, timeout: timedelta) -> dist.ProcessGroup:
    """One group per row of `slices` (collective: every rank creates every group); this rank's."""
    mine = None
    for ranks in slices.tolist():
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def restarted_group_store(world: int, timeout: timedelta) -> dict:
    """`init_process_group`'s store for a worker group torchrun restarted (`--max-restarts`): {} for the first.

    torchrun's workers share the agent's store (TORCHELASTIC_USE_AGENT_STORE), which outlives a failed worker
    group, and torch keys a new group's rendezvous without the attempt: a restarted group reads the dead
    group's addresses and never connects (gloo: "connectFullMesh failed ... Connection refused"; NCCL alike,
    pytorch/pytorch#167288). Each restart keys its process groups (and the heartbeat) under its own prefix."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or "MASTER_ADDR" not in os.environ:
        return {}
    rank = int(os.environ["RANK"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 serves the store, as torch does
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent and rank == 0, timeout=timeout, multi_tenant=not agent)
    return {"store": dist.PrefixStore(f"meshlm/attempt_{attempt}", store), "rank": rank, "world_size": world}


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
                                device_id=device if device.type == "cuda" else None,
                                **restarted_group_store(world, timedelta(seconds=cfg.timeout_s)))
    return ParallelDims.build(cfg.tp, cfg.pp, cfg.dp, cp=cfg.cp, ep=cfg.ep, timeout_s=cfg.timeout_s, device=device)


def destroy(wait_for_all: bool = False) -> None:
    """Tear down every process group (safe to call when none exists). After a run that ended well, pass
    `wait_for_all`: a barrier first, so that no rank tears gloo down while another still talks to it (that
    can abort the other with "terminate called without an active exception"). After an error, don't:
    the other ranks may be gone, and the barrier would wait for its timeout."""
    if dist.is_initialized():
        if wait_for_all:
            dist.barrier()
        dist.destroy_process_group()
