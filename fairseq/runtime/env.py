"""Work out how this process was launched and what its place in the job is.

`detect_launch` reads the distributed config and the environment (passed in, so tests can inject it) and
returns a `LaunchPlan`. It does not touch torch.distributed; `fairseq.distributed.launch` acts on the plan.

Detection order (the first that applies wins):

1. `--distributed-init-method` given: the user placed the ranks (`--distributed-rank` is the rank of this
   process, or of the first process it spawns).
2. torchrun: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are all set; rendezvous via env://.
3. SLURM (SLURM_JOB_ID, SLURM_PROCID and a node list are set). One task per GPU: rank SLURM_PROCID, local
   rank SLURM_LOCALID, world SLURM_NTASKS. One task per node (and more than one process wanted per node):
   this task spawns one process per local GPU (or --distributed-num-procs). The first host of the node list
   is the master; the port is --distributed-port, required when the job spans several nodes.
4. No launcher and --distributed-world-size N > 1: spawn N processes on this machine.
5. Otherwise a single process, no process group.
"""

import logging
import os
import re
import signal
import socket
from dataclasses import dataclass, replace
from typing import List, Mapping, Optional

logger = logging.getLogger(__name__)

LAUNCH_MODES = ("single", "explicit", "torchrun", "slurm_per_gpu", "slurm_per_node", "spawn")
TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Signals a scheduler sends before taking the job away (SLURM's --signal, its preemption): the launcher passes
# them on to the ranks, whose training saves a checkpoint (fairseq.training.preemption).
PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)

# Ports derived from a SLURM job id fall in [10000, 30000): below Linux's ephemeral range (32768+), so a
# port picked for us by the kernel elsewhere is unlikely to collide with it.
_DERIVED_PORT_BASE = 10000
_DERIVED_PORT_SPAN = 20000


@dataclass(frozen=True)
class LaunchPlan:
    """Where this process sits in the job.

    When `nprocs_to_spawn` > 0 this process is only a launcher: it starts that many local processes, and
    `rank` / `local_rank` are those of the first one (see `for_spawned_process`).
    """

    mode: str
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    init_method: Optional[str] = None
    nprocs_to_spawn: int = 0
    master_addr: Optional[str] = None
    master_port: Optional[int] = None

    def __post_init__(self):
        if self.mode not in LAUNCH_MODES:
            raise ValueError(f"unknown launch mode {self.mode!r}; expected one of {LAUNCH_MODES}")

    @property
    def is_distributed(self) -> bool:
        return self.mode != "single"

    def for_spawned_process(self, index: int) -> "LaunchPlan":
        """The plan of the `index`-th process this launcher spawns."""
        if not 0 <= index < self.nprocs_to_spawn:
            raise ValueError(f"process index {index} out of range for {self.nprocs_to_spawn} spawned processes")
        return replace(self, rank=self.rank + index, local_rank=self.local_rank + index, nprocs_to_spawn=0)


# ---------------------------------------------------------------------------------------------- node lists


def _split_outside_brackets(text: str, source: str) -> List[str]:
    """Split on commas that are not inside [...]."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"node list {source!r}: nested '[' is not valid host list syntax")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"node list {source!r}: ']' without a matching '['")
        elif ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"node list {source!r}: '[' without a matching ']'")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_bracket(body: str, source: str) -> List[str]:
    """'001-004,007' -> ['001', '002', '003', '004', '007'] (zero padding kept from the range start)."""
    values = []
    for part in body.split(","):
        part = part.strip()
        if re.fullmatch(r"\d+", part):
            values.append(part)
            continue
        match = re.fullmatch(r"(\d+)-(\d+)", part)
        if not match:
            raise ValueError(f"node list {source!r}: cannot read range {part!r} inside [...]")
        first, last = match.group(1), match.group(2)
        if int(last) < int(first):
            raise ValueError(f"node list {source!r}: range {part!r} runs backwards")
        width = len(first)
        values.extend(str(n).zfill(width) for n in range(int(first), int(last) + 1))
    return values


def _expand_host_pattern(pattern: str, source: str) -> List[str]:
    """One host pattern, possibly with several bracket groups: 'a[1-2]-b[3-4]' -> a1-b3, a1-b4, a2-b3, a2-b4."""
    hosts = [""]
    for literal, bracket in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", pattern):
        choices = _expand_bracket(bracket, source) if bracket else [""]
        hosts = [host + literal + choice for host in hosts for choice in choices]
    return hosts


def expand_nodelist(nodelist: str) -> List[str]:
    """Expand a SLURM host list the way `scontrol show hostnames` does, without needing scontrol.

    >>> expand_nodelist("gpu[001-003,007],cpu-a[1-2]")
    ['gpu001', 'gpu002', 'gpu003', 'gpu007', 'cpu-a1', 'cpu-a2']
    """
    hosts = []
    for pattern in _split_outside_brackets(nodelist.strip(), nodelist):
        hosts.extend(_expand_host_pattern(pattern, nodelist))
    if not hosts:
        raise ValueError(f"node list {nodelist!r} names no hosts")
    return hosts


# ------------------------------------------------------------------------------------------------- helpers


def _env_int(environ: Mapping[str, str], name: str, default: Optional[int] = None) -> Optional[int]:
    value = environ.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _tasks_per_node(environ: Mapping[str, str]) -> Optional[int]:
    """Tasks on this node from SLURM_NTASKS_PER_NODE or SLURM_STEP_TASKS_PER_NODE ('4(x2),3' -> 4)."""
    for name in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        value = environ.get(name)
        if value:
            match = re.match(r"\s*(\d+)", value)
            if not match:
                raise ValueError(f"environment variable {name}={value!r}: expected a count such as '4' or '4(x2)'")
            return int(match.group(1))
    return None


def _port_from_job_id(job_id: str, step_id: Optional[str]) -> int:
    """A port every task of the job computes alike; the step id keeps concurrent steps of a job apart."""
    digits = int(re.sub(r"\D", "", job_id) or 0) + int(re.sub(r"\D", "", step_id or "") or 0)
    return _DERIVED_PORT_BASE + digits % _DERIVED_PORT_SPAN


def get_free_port(host: str = "") -> int:
    """A TCP port the kernel reports free right now (another process may still take it before we do)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _local_gpu_count(cpu: bool, gpu_count: Optional[int]) -> int:
    if cpu:
        return 0
    if gpu_count is not None:
        return gpu_count
    import torch  # deferred: startup (reading a config or an environment should not pay for importing torch)

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# ----------------------------------------------------------------------------------------------- detection


def _explicit_plan(cfg, gpus: int) -> LaunchPlan:
    world = cfg.distributed_world_size
    base_rank = cfg.distributed_rank or 0
    if cfg.distributed_num_procs:
        nprocs = cfg.distributed_num_procs
    elif gpus > 1:
        nprocs = min(gpus, world)
    else:
        nprocs = 1  # on CPU each invocation is one rank: start one per rank with its --distributed-rank
    if cfg.distributed_no_spawn or nprocs <= 1:
        return LaunchPlan(
            "explicit",
            rank=base_rank,
            local_rank=cfg.device_id,
            world_size=world,
            init_method=cfg.distributed_init_method,
        )
    if base_rank + nprocs > world:
        raise ValueError(
            f"--distributed-rank {base_rank} plus {nprocs} local processes exceeds --distributed-world-size "
            f"{world}; to start one rank per command pass --distributed-no-spawn, otherwise give each node "
            "the rank of its first process and --distributed-num-procs"
        )
    return LaunchPlan(
        "explicit",
        rank=base_rank,
        local_rank=0,
        world_size=world,
        init_method=cfg.distributed_init_method,
        nprocs_to_spawn=nprocs,
    )


def _torchrun_plan(cfg, environ: Mapping[str, str]) -> LaunchPlan:
    world = _env_int(environ, "WORLD_SIZE")
    if cfg.distributed_world_size not in (1, world):
        logger.warning(
            "--distributed-world-size %d ignored: torchrun set WORLD_SIZE=%d", cfg.distributed_world_size, world
        )
    return LaunchPlan(
        "torchrun",
        rank=_env_int(environ, "RANK"),
        local_rank=_env_int(environ, "LOCAL_RANK"),
        world_size=world,
        init_method="env://",
        master_addr=environ["MASTER_ADDR"],
        master_port=_env_int(environ, "MASTER_PORT"),
    )


def _slurm_plan(cfg, environ: Mapping[str, str], gpus: int) -> Optional[LaunchPlan]:
    nodelist_var = next((v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST") if environ.get(v)), None)
    if not environ.get("SLURM_JOB_ID") or environ.get("SLURM_PROCID") is None or nodelist_var is None:
        return None
    try:
        hosts = expand_nodelist(environ[nodelist_var])
    except ValueError as err:
        raise ValueError(f"{nodelist_var}: {err}") from None
    nnodes = _env_int(environ, "SLURM_STEP_NUM_NODES") or _env_int(environ, "SLURM_NNODES") or len(hosts)
    ntasks = _env_int(environ, "SLURM_STEP_NUM_TASKS") or _env_int(environ, "SLURM_NTASKS") or nnodes
    tasks_per_node = _tasks_per_node(environ) or max(1, ntasks // nnodes)
    procid = _env_int(environ, "SLURM_PROCID")

    # With one task per node, that task spawns the node's processes: one per GPU, or as many as asked for.
    procs_per_node = cfg.distributed_num_procs or (gpus if gpus > 0 else max(1, cfg.distributed_world_size // nnodes))
    per_node = tasks_per_node == 1 and procs_per_node > 1 and not cfg.distributed_no_spawn

    if per_node:
        node_id = _env_int(environ, "SLURM_NODEID", procid)
        world, rank, local_rank, nprocs = nnodes * procs_per_node, node_id * procs_per_node, 0, procs_per_node
        mode = "slurm_per_node"
    else:
        world, rank, nprocs = ntasks, procid, 0
        local_rank = _env_int(environ, "SLURM_LOCALID", 0)
        mode = "slurm_per_gpu"
    if world == 1:
        return LaunchPlan("single")
    if cfg.distributed_world_size not in (1, world):
        logger.warning(
            "--distributed-world-size %d ignored: the SLURM allocation gives %d processes",
            cfg.distributed_world_size,
            world,
        )

    port = _slurm_port(cfg, environ, nnodes, hosts[0], per_node)
    master = hosts[0]
    return LaunchPlan(
        mode,
        rank=rank,
        local_rank=local_rank,
        world_size=world,
        init_method=f"tcp://{master}:{port}",
        nprocs_to_spawn=nprocs,
        master_addr=master,
        master_port=port,
    )


def _slurm_port(cfg, environ: Mapping[str, str], nnodes: int, master: str, per_node: bool) -> int:
    """--distributed-port; without it (one node only) a free port when this task spawns the node's processes,
    else one derived from the job and step ids, the same in every task."""
    if cfg.distributed_port and cfg.distributed_port > 0:
        return cfg.distributed_port
    if nnodes > 1:
        raise ValueError(
            f"SLURM job {environ['SLURM_JOB_ID']} spans {nnodes} nodes: pass --distributed-port PORT "
            f"(a free TCP port on {master}, the same on every node) so the ranks can meet"
        )
    if per_node:
        return get_free_port()  # only this process picks it and hands it to its children
    return _port_from_job_id(environ["SLURM_JOB_ID"], environ.get("SLURM_STEP_ID"))


def _spawn_plan(cfg, gpus: int) -> LaunchPlan:
    world = cfg.distributed_world_size
    if cfg.distributed_no_spawn:
        raise ValueError(
            f"--distributed-no-spawn with --distributed-world-size {world} needs the ranks started for it: "
            "use torchrun or srun, or pass --distributed-init-method and --distributed-rank to each process"
        )
    if gpus > 0 and world > gpus:
        raise ValueError(
            f"--distributed-world-size {world} is more than the {gpus} GPUs on this machine; with no launcher "
            "all ranks run here. Use torchrun/srun across nodes, or --cpu to run CPU processes"
        )
    port = cfg.distributed_port if cfg.distributed_port and cfg.distributed_port > 0 else get_free_port()
    return LaunchPlan(
        "spawn",
        rank=0,
        local_rank=0,
        world_size=world,
        init_method=f"tcp://localhost:{port}",
        nprocs_to_spawn=world,
        master_addr="localhost",
        master_port=port,
    )


def detect_launch(
    cfg_distributed, environ: Mapping[str, str] = os.environ, *, cpu: bool = False, gpu_count: Optional[int] = None
) -> LaunchPlan:
    """Decide how this process takes part in the job (see the module docstring for the order).

    `cfg_distributed` is a DistributedTrainingConfig (or anything with its fields); `cpu` is --cpu;
    `gpu_count` overrides torch.cuda.device_count() (tests). On CPU, spawned process counts come from
    --distributed-world-size (or --distributed-num-procs) instead of the GPU count.
    """
    cfg = cfg_distributed
    gpus = _local_gpu_count(cpu, gpu_count)
    if cfg.distributed_world_size < 1:
        raise ValueError(f"--distributed-world-size must be at least 1, got {cfg.distributed_world_size}")

    if cfg.distributed_init_method:
        return _explicit_plan(cfg, gpus)

    present = [name for name in TORCHRUN_VARS if environ.get(name)]
    if len(present) == len(TORCHRUN_VARS):
        return _torchrun_plan(cfg, environ)
    if "RANK" in present or "LOCAL_RANK" in present:
        missing = [name for name in TORCHRUN_VARS if name not in present]
        logger.warning("ignoring a partial torchrun environment: %s not set", ", ".join(missing))

    slurm = _slurm_plan(cfg, environ, gpus)
    if slurm is not None:
        return slurm

    if cfg.distributed_world_size > 1:
        return _spawn_plan(cfg, gpus)
    return LaunchPlan("single")
