"""Pipeline settings: their names and aliases (:mod:`.settings`), the validated configuration
(:mod:`.pipeline_config`)."""

from .pipeline_config import PipelineConfig
from .settings import EXACT_F32

__all__ = ["EXACT_F32", "PipelineConfig"]
