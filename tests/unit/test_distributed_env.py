"""Launch detection and SLURM node-list expansion, with injected environments (no processes started)."""

import pytest

from fairseq.dataclass.configs import DistributedTrainingConfig
from fairseq.runtime.env import LaunchPlan, detect_launch, expand_nodelist
from fairseq.distributed.launch import apply_default_env, process_group_timeout

TORCHRUN_ENV = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "head", "MASTER_PORT": "29511"}


def slurm_env(procid=0, localid=0, ntasks=2, tasks_per_node=2, nnodes=1, nodelist="gpu[001-002]", **extra):
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(procid // tasks_per_node),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_NTASKS_PER_NODE": str(tasks_per_node),
        "SLURM_NNODES": str(nnodes),
        "SLURM_JOB_NODELIST": nodelist,
    }
    env.update(extra)
    return env


def dist_cfg(**overrides):
    cfg = DistributedTrainingConfig()
    for name, value in overrides.items():
        setattr(cfg, name, value)
    return cfg


# ------------------------------------------------------------------------------------------ expand_nodelist


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu[001-004,007]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007"]),
        ("node1,node2", ["node1", "node2"]),
        ("a[9-11]", ["a9", "a10", "a11"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("localhost", ["localhost"]),
        ("gpu[001-002,007],cpu-a[1-2]", ["gpu001", "gpu002", "gpu007", "cpu-a1", "cpu-a2"]),
        ("solo,rack[3,5]-n[1-2]", ["solo", "rack3-n1", "rack3-n2", "rack5-n1", "rack5-n2"]),
        ("a[1-2]-b[3-4]", ["a1-b3", "a1-b4", "a2-b3", "a2-b4"]),
        (" x[1-2] , y ", ["x1", "x2", "y"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[001-004", "gpu001-004]", "gpu[a-b]", "gpu[5-3]", "a[[1]]", ""])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(bad)


# ---------------------------------------------------------------------------------------- detection order


def test_no_launcher_world_size_one_is_single():
    plan = detect_launch(dist_cfg(), environ={}, gpu_count=0)
    assert plan == LaunchPlan("single")
    assert not plan.is_distributed


def test_explicit_init_method_beats_torchrun_and_slurm():
    cfg = dist_cfg(
        distributed_init_method="tcp://10.0.0.1:4000",
        distributed_world_size=4,
        distributed_rank=2,
        distributed_no_spawn=True,
        device_id=1,
    )
    plan = detect_launch(cfg, environ={**TORCHRUN_ENV, **slurm_env()}, gpu_count=2)
    assert (plan.mode, plan.rank, plan.local_rank, plan.world_size) == ("explicit", 2, 1, 4)
    assert plan.init_method == "tcp://10.0.0.1:4000"
    assert plan.nprocs_to_spawn == 0


def test_explicit_init_method_rank_past_world_suggests_no_spawn():
    cfg = dist_cfg(distributed_init_method="tcp://h:1", distributed_world_size=2, distributed_rank=1)
    with pytest.raises(ValueError, match="--distributed-no-spawn"):
        detect_launch(cfg, environ={}, gpu_count=2)


def test_explicit_init_method_spawns_one_process_per_gpu():
    cfg = dist_cfg(distributed_init_method="tcp://10.0.0.1:4000", distributed_world_size=8, distributed_rank=4)
    plan = detect_launch(cfg, environ={}, gpu_count=4)
    assert (plan.mode, plan.nprocs_to_spawn, plan.rank, plan.world_size) == ("explicit", 4, 4, 8)
    assert [plan.for_spawned_process(i).rank for i in range(4)] == [4, 5, 6, 7]
    assert [plan.for_spawned_process(i).local_rank for i in range(4)] == [0, 1, 2, 3]


def test_torchrun_beats_slurm():
    plan = detect_launch(dist_cfg(), environ={**TORCHRUN_ENV, **slurm_env()}, gpu_count=2)
    assert plan == LaunchPlan(
        "torchrun", rank=3, local_rank=1, world_size=8, init_method="env://", master_addr="head", master_port=29511
    )


def test_partial_torchrun_environment_is_not_torchrun():
    environ = {k: v for k, v in TORCHRUN_ENV.items() if k != "MASTER_PORT"}
    assert detect_launch(dist_cfg(), environ=environ, gpu_count=0).mode == "single"


def test_torchrun_with_non_integer_rank_names_the_variable():
    with pytest.raises(ValueError, match="RANK='x'"):
        detect_launch(dist_cfg(), environ={**TORCHRUN_ENV, "RANK": "x"}, gpu_count=0)


# ------------------------------------------------------------------------------------------------- SLURM


def test_slurm_one_task_per_gpu():
    environ = slurm_env(procid=5, localid=1, ntasks=8, tasks_per_node=4, nnodes=2, nodelist="gpu[001-002]")
    plan = detect_launch(dist_cfg(distributed_port=12345), environ=environ, gpu_count=4)
    assert (plan.mode, plan.rank, plan.local_rank, plan.world_size) == ("slurm_per_gpu", 5, 1, 8)
    assert plan.init_method == "tcp://gpu001:12345"
    assert (plan.master_addr, plan.master_port, plan.nprocs_to_spawn) == ("gpu001", 12345, 0)


def test_slurm_step_nodelist_preferred_over_job_nodelist():
    environ = slurm_env(ntasks=4, nnodes=2, nodelist="big[1-8]", SLURM_STEP_NODELIST="big[5-6]")
    plan = detect_launch(dist_cfg(distributed_port=2222), environ=environ, gpu_count=2)
    assert plan.master_addr == "big5"


def test_slurm_step_tasks_per_node_format():
    environ = slurm_env(procid=3, localid=1, ntasks=4, nnodes=2, nodelist="n[1-2]")
    del environ["SLURM_NTASKS_PER_NODE"]
    environ["SLURM_STEP_TASKS_PER_NODE"] = "2(x2)"
    plan = detect_launch(dist_cfg(distributed_port=2222), environ=environ, gpu_count=2)
    assert (plan.mode, plan.rank, plan.local_rank, plan.world_size) == ("slurm_per_gpu", 3, 1, 4)


def test_slurm_one_task_per_node_spawns_per_gpu():
    environ = slurm_env(procid=1, ntasks=2, tasks_per_node=1, nnodes=2, nodelist="gpu[001-002]")
    plan = detect_launch(dist_cfg(distributed_port=3333), environ=environ, gpu_count=8)
    assert (plan.mode, plan.nprocs_to_spawn, plan.world_size) == ("slurm_per_node", 8, 16)
    assert [plan.for_spawned_process(i).rank for i in (0, 7)] == [8, 15]
    assert plan.for_spawned_process(7).local_rank == 7
    assert plan.init_method == "tcp://gpu001:3333"


def test_slurm_one_task_per_node_on_cpu_uses_num_procs():
    environ = slurm_env(procid=0, ntasks=1, tasks_per_node=1, nnodes=1, nodelist="localhost")
    plan = detect_launch(dist_cfg(distributed_num_procs=3), environ=environ, cpu=True)
    assert (plan.mode, plan.nprocs_to_spawn, plan.world_size, plan.rank) == ("slurm_per_node", 3, 3, 0)
    assert plan.init_method.startswith("tcp://localhost:")


def test_slurm_several_nodes_without_port_names_the_flag():
    environ = slurm_env(procid=0, ntasks=4, tasks_per_node=2, nnodes=2, nodelist="gpu[001-002]")
    with pytest.raises(ValueError, match="--distributed-port"):
        detect_launch(dist_cfg(), environ=environ, gpu_count=2)


def test_slurm_single_node_without_port_derives_the_same_port_on_every_task():
    plans = [
        detect_launch(dist_cfg(), environ=slurm_env(procid=r, localid=r, nodelist="gpu007"), gpu_count=2)
        for r in (0, 1)
    ]
    assert plans[0].master_port == plans[1].master_port
    assert 10000 <= plans[0].master_port < 30000
    assert plans[0].init_method == f"tcp://gpu007:{plans[0].master_port}"


def test_slurm_single_task_single_gpu_is_single():
    environ = slurm_env(ntasks=1, tasks_per_node=1, nodelist="gpu001")
    assert detect_launch(dist_cfg(), environ=environ, gpu_count=1).mode == "single"


def test_slurm_bad_nodelist_names_the_variable():
    environ = slurm_env(nodelist="gpu[001-")
    with pytest.raises(ValueError, match="SLURM_JOB_NODELIST"):
        detect_launch(dist_cfg(distributed_port=1), environ=environ, gpu_count=2)


# ------------------------------------------------------------------------------------------------- spawn


def test_spawn_without_launcher_on_cpu():
    plan = detect_launch(dist_cfg(distributed_world_size=2), environ={}, cpu=True, gpu_count=4)
    assert (plan.mode, plan.nprocs_to_spawn, plan.world_size, plan.rank) == ("spawn", 2, 2, 0)
    assert plan.init_method == f"tcp://localhost:{plan.master_port}"
    assert [plan.for_spawned_process(i).rank for i in (0, 1)] == [0, 1]


def test_spawn_uses_the_given_port():
    plan = detect_launch(dist_cfg(distributed_world_size=2, distributed_port=4567), environ={}, gpu_count=2)
    assert plan.init_method == "tcp://localhost:4567"


def test_spawn_more_ranks_than_gpus_is_an_error():
    with pytest.raises(ValueError, match="--distributed-world-size 4"):
        detect_launch(dist_cfg(distributed_world_size=4), environ={}, gpu_count=2)


def test_no_spawn_without_launcher_is_an_error():
    with pytest.raises(ValueError, match="--distributed-no-spawn"):
        detect_launch(dist_cfg(distributed_world_size=2, distributed_no_spawn=True), environ={}, cpu=True)


def test_spawned_process_index_out_of_range():
    plan = detect_launch(dist_cfg(distributed_world_size=2), environ={}, cpu=True)
    with pytest.raises(ValueError, match="out of range"):
        plan.for_spawned_process(2)


# ------------------------------------------------------------------------------------- environment defaults


def test_apply_default_env_sets_only_what_is_unset():
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    applied = apply_default_env(environ)
    assert applied == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000"}
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    assert "NCCL_NVLS_ENABLE" not in environ


def test_apply_default_env_respects_legacy_spellings_and_nvls():
    environ = {
        "NCCL_ASYNC_ERROR_HANDLING": "0",
        "PYTORCH_ALLOC_CONF": "x",
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "60000",
    }
    before = dict(environ)
    assert apply_default_env(environ) == {}
    assert environ == before


def test_apply_default_env_on_empty_environment():
    environ = {}
    apply_default_env(environ)
    assert environ == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "1000",
    }


@pytest.mark.parametrize("heartbeat, seconds", [(-1, 600), (0, 600), (7, 7)])
def test_process_group_timeout(heartbeat, seconds):
    assert process_group_timeout(dist_cfg(heartbeat_timeout=heartbeat)).total_seconds() == seconds
