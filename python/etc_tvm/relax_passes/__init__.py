"""The etc Relax passes, one a file, and the pipeline that composes them for tvm.compile."""
from .pipeline import etc_passes, pipeline
from .static_schedule_transform import StaticScheduleTransform

__all__ = ["StaticScheduleTransform", "etc_passes", "pipeline"]
