"""The etc Relax passes, one a file, and the pipeline that composes them for tvm.compile."""
from .barrier_edges_transform import BarrierEdgesTransform
from .dynamic_schedule_transform import DynamicScheduleTransform
from .mixed_schedule_transform import MixedScheduleTransform
from .pipeline import STRATEGIES, cuda_target, etc_passes, pipeline
from .static_schedule_transform import StaticScheduleTransform
from .unfused_transform import UnfusedTransform

__all__ = ["STRATEGIES", "BarrierEdgesTransform", "DynamicScheduleTransform",
           "MixedScheduleTransform", "StaticScheduleTransform", "UnfusedTransform", "cuda_target",
           "etc_passes", "pipeline"]
