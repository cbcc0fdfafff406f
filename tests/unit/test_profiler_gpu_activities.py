"""Which kineto records the per-update profile counts as GPU work (fairseq.logging.profiler.gpu_activities).

Kernels launched by inductor (triton, through the driver API) have a host range of the same name, and torch
< 2.12's kineto records carry no activity type: the selection must keep such a kernel and drop the ranges
mirrored on the device. torch 2.11's record type is not in this torch, so a record class with its methods
stands in for it; the torch-2.12+ branch also runs on real records."""

import torch

from fairseq.logging.profiler import gpu_activities

CPU, CUDA = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA


class Record:  # torch 2.11's _KinetoEvent, the methods gpu_activities reads
    def __init__(self, name, device, activity, user_annotation=False):
        self._name, self._device, self._activity, self._annotation = name, device, activity, user_annotation

    def name(self):
        return self._name

    def device_type(self):
        return self._device

    def is_user_annotation(self):
        return self._annotation


class RecordWithActivity(Record):  # torch >= 2.12
    def activity_type(self):
        return self._activity


def trace(with_activity):
    cls = RecordWithActivity if with_activity else Record
    return [
        cls("update 3", CPU, "user_annotation", True),
        cls("update 3", CUDA, "gpu_user_annotation", True),  # the range, mirrored on the device
        cls("triton_red_fused_abs_max_0", CPU, "user_annotation", True),  # inductor's launch range
        cls("triton_red_fused_abs_max_0", CUDA, "kernel"),  # ... and its kernel: same name
        cls("aten::mm", CPU, "cpu_op"),
        cls("nvjet_sm90_tst_256x128", CUDA, "kernel"),
        cls("Memcpy HtoD (Pinned -> Device)", CUDA, "gpu_memcpy"),
        cls("Memset (Device)", CUDA, "gpu_memset"),
        cls("Command Buffer Full", CUDA, "cuda_driver"),  # a CUPTI marker, not work
    ]


EXPECTED = ["triton_red_fused_abs_max_0", "nvjet_sm90_tst_256x128", "Memcpy HtoD (Pinned -> Device)", "Memset (Device)"]


def test_records_with_an_activity_type():
    assert [e.name() for e in gpu_activities(trace(with_activity=True))] == EXPECTED


def test_records_without_one_keep_a_kernel_named_like_its_launch_range():
    records = trace(with_activity=False)
    assert not hasattr(records[0], "activity_type")
    assert [e.name() for e in gpu_activities(records)] == EXPECTED


def test_real_cpu_records_hold_no_gpu_work():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("update 1"):
            torch.ones(8).sum()
    records = prof.profiler.kineto_results.events()
    assert any(e.name() == "aten::sum" for e in records) and gpu_activities(records) == []
    assert gpu_activities([]) == []
